"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`.

Runs the same EngineCore as the server, synchronously: add every request,
step until all finish, return the final outputs in input order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvserve.config import DEFAULT_KV_CACHE_MEMORY
from kvserve.contract import SamplingParams
from kvserve.engine.core import EngineConfig, EngineCore
from kvserve.engine.outputs import RequestOutput
from kvserve.model.loader import load_model

Prompt = str | Sequence[int]
Messages = list[dict]


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, dtype: str = "float32",
                 kv_cache_memory: str | int = DEFAULT_KV_CACHE_MEMORY, block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 device: str | None = None, max_model_len: int | None = None, seed: int = 0,
                 enforce_eager: bool = False, quantization: str = "auto", prefill_weights: str = "auto",
                 batch_invariant: bool = False, kv_cache_dtype: str = "auto",
                 speculative_config: dict | str | None = None, enable_lora: bool = False,
                 max_loras: int = 4, max_lora_rank: int = 16) -> None:
        """Load `model` (None: the embedded SmolLM2-135M-Instruct; a *.gguf file or a
        Hugging Face folder) and size the KV cache to `kv_cache_memory` ("2GiB", bytes, or
        "auto": what the resident weights leave of 1.5 GiB; default 1GiB, as `kvserve serve`).
        quantization: "auto" (a GGUF's Q8_0 / Q4_0 / Q4_1 matrices computed quantized),
        "none" (the float path, the reference), or "q8_0" / "q4_0" / "q4_1" (every matrix
        in that type). prefill_weights: "auto" (prompt positions of a quantized model on a
        bfloat16 copy of its layers where the CPU has AMX-BF16 and the copy takes at most
        1 GiB), "bf16" (that copy at any size, or refuse),
        "none" (the quantized kernels, as decode). batch_invariant: a request's tokens
        the same alone or in any batch (its prompt rows on that copy, its generated
        rows never; by default a step of 32 rows or more takes the copy for every
        row). kv_cache_dtype: the KV cache's element type,
        "auto" (bfloat16 for quantized weights on CPU, else dtype), "float32", "bfloat16"
        (half a float32 model's bytes per token) or "int8" (a scale per head and token;
        quantized CPU models).
        speculative_config: speculative decoding with vLLM's keys, e.g.
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2} or {"method": "draft_model", "model": PATH,
        "num_speculative_tokens": 4} (config.SpeculativeConfig). enable_lora: serve
        LoRA adapters (`load_lora_adapter`, then `generate(..., lora=name)`), at
        most max_loras in one step, of rank <= max_lora_rank."""
        config = EngineConfig.from_sizes(
            kv_cache_memory, dtype=dtype, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            device=device, max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
            quantization=quantization, prefill_weights=prefill_weights, batch_invariant=batch_invariant,
            kv_cache_dtype=kv_cache_dtype,
            speculative_config=speculative_config,
            enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank)
        loaded = load_model(model, quantization=quantization)
        self.engine = EngineCore(loaded.config, loaded.weights, loaded.tokenizer, config,
                                 versions=loaded.versions)
        self.tokenizer = loaded.tokenizer
        self.versions = loaded.versions
        self.source = loaded.source

    def load_lora_adapter(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT LoRA folder at `path` as `name` (needs enable_lora);
        raises ValueError naming what is wrong with the folder."""
        self.engine.load_lora_adapter(name, str(path))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Complete each prompt (a string or a list of token ids); outputs in input order.
        `lora`: the loaded adapter every prompt runs under, or one name (or None,
        the base model) per prompt. A bad prompt raises ValueError and leaves nothing queued."""
        prompt_ids = [self._prompt_token_ids(p) for p in _as_prompt_list(prompts)]
        return self._run(prompt_ids, _params_for(sampling_params, len(prompt_ids)),
                         self._adapter_ids(lora, len(prompt_ids)))

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} dicts) or a list of
        conversations, rendered with the model's chat template (`lora` as in generate)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompt_ids = [self._chat_token_ids(conversation) for conversation in conversations]
        return self._run(prompt_ids, _params_for(sampling_params, len(prompt_ids)),
                         self._adapter_ids(lora, len(prompt_ids)))

    def _adapter_ids(self, lora: str | Sequence[str | None] | None, num_prompts: int) -> list[str | None]:
        names = [lora] * num_prompts if lora is None or isinstance(lora, str) else list(lora)
        if len(names) != num_prompts:
            raise ValueError(f"got {len(names)} lora names for {num_prompts} prompts")
        ids: list[str | None] = []
        for name in names:
            adapter = None if name is None else self.engine.adapters.get(name)
            if name is not None and adapter is None:
                raise ValueError(f"no LoRA adapter named {name!r} is loaded")
            ids.append(None if adapter is None else adapter.adapter_id)
        return ids

    def _prompt_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _chat_token_ids(self, conversation: Messages) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        # The template writes any BOS itself; encoding must not add another.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _run(self, prompt_ids: list[list[int]], params: list[SamplingParams],
             adapter_ids: list[str | None]) -> list[RequestOutput]:
        engine = self.engine
        # Compile every constraint first: a bad one raises InvalidParameter
        # before anything is queued.
        compiles = [engine.structured.submit(p.structured_output) for p in params if p.structured_output]
        for future in compiles:
            future.result()
        requests = [engine.new_request(ids, p, adapter_id=a) for ids, p, a in zip(prompt_ids, params, adapter_ids)]
        added = []
        try:
            for request in requests:
                engine.add_request(request)
                added.append(request)
        except ValueError:
            for request in added:  # all or nothing: leave the engine as it was
                engine.abort(request.request_id)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(requests):
            for output in engine.step().outputs:
                if output.finished:
                    final[output.request_id] = output
        return [final[r.request_id] for r in requests]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must not be empty")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _params_for(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling_params for {num_prompts} prompts")
    return params
