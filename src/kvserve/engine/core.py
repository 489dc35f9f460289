"""EngineCore: one step of the engine is schedule -> execute -> update.

The core is synchronous and single-threaded: the offline `LLM` calls `step()`
in a loop, the async server drives it from a background loop. It owns the
scheduler (which requests run, KV blocks), the model runner (tensors, forward
pass, sampling) and one incremental detokenizer per request (text deltas,
stop strings). A request with a structured-output constraint waits outside
the scheduler until its grammar is compiled (on the compiler's worker
thread), so a large schema delays only its own request. `step()` returns a
`StepResult`: the outputs, the batch that ran (its shape, the requests it
started) and whether it captured a CUDA graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvserve.admission.step_limits import StepLimits
from kvserve.config import (DEFAULT_KV_CACHE_MEMORY, KV_CACHE_DTYPE_CHOICES, PREFILL_WEIGHTS_CHOICES, CacheConfig,
                            SchedulerConfig, SpeculativeConfig, parse_size)
from kvserve.contract import InvalidParameter, Request, RequestFactory, RequestStatus, ResolvedVersions, SamplingParams
from kvserve.engine.adapters import AdapterRegistry
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.speculative import SpecDecodeCounts, Speculator
from kvserve.model_facts.config import ModelConfig
from kvserve.model.detokenizer import IncrementalDetokenizer
from kvserve.model.lora import LoraAdapter, read_lora_adapter, read_lora_identity
from kvserve.model.sampler import SamplerOutput, SamplingState, TokenLogprob
from kvserve.model.quantized import check_quantization
from kvserve.model_facts.tokenizer import Tokenizer
from kvserve.runner.model_runner import ModelRunner, kv_bytes_per_block
from kvserve.scheduler.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from kvserve.structured import CompiledGrammar, GrammarCompiler

if TYPE_CHECKING:
    from kvserve.runner.draft_model import DraftModelProposer

log = logging.getLogger(__name__)
# How long an idle step waits for a grammar compile before returning empty.
COMPILE_WAIT_S = 0.05


@dataclass(frozen=True)
class EngineConfig:
    """How the engine is sized. kv_cache_memory_bytes is turned into a number
    of blocks by the runner (None: AUTO_ENGINE_MEMORY_BYTES less the resident
    weights, a draft model's included, so smaller weights leave a larger
    cache; a draft model's cache is paid from the same bytes); max_model_len (tokens)
    defaults to the model's context and is capped by it."""

    dtype: str = "float32"
    kv_cache_memory_bytes: int | None = parse_size(DEFAULT_KV_CACHE_MEMORY)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    device: str | None = None  # None: CUDA when available, else CPU
    max_model_len: int | None = None
    seed: int = 0  # seeds the sampler's generator for unseeded requests
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (they are used only on CUDA)
    # auto: the file's quantized matrices stay quantized; none: the float path;
    # q8_0 / q4_0 / q4_1: every matrix in that type (model/quantized.py)
    quantization: str = "auto"
    # Prompt positions of a quantized model: auto = bfloat16 tiles on AMX-BF16
    # CPUs (+2 bytes per layer weight) up to 1 GiB of them, bf16 = those at any
    # size or refuse, none = as decode (model/quantized.wants_prompt_tiles).
    prefill_weights: str = "auto"
    # Where a quantized model holds those tiles, a step of 32 rows or more
    # computes every row on them, generated ones too (faster under load; a
    # row's last bits then depend on its step). True: by position instead, a
    # request's prompt rows on the tiles and its generated rows never, so its
    # tokens are the same alone or in any batch (model/quantized.tiles_from).
    batch_invariant: bool = False
    # The KV cache's element type: auto = bfloat16 for quantized weights on
    # CPU, else dtype (model_runner.auto_kv_cache_dtype); bfloat16 halves a
    # float32 model's KV bytes per token (twice the tokens in the same memory);
    # int8 (quantized CPU models): a scale per row, 1.88x bfloat16's tokens at head_dim 64.
    kv_cache_dtype: str = "auto"
    # Speculative decoding (None: off); a JSON text or dict of vLLM's keys is parsed.
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (model/lora.py): served only with enable_lora; at most
    # max_loras resident at once (and so in one step), each of rank <= max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16

    @classmethod
    def from_sizes(cls, kv_cache_memory: str | int = DEFAULT_KV_CACHE_MEMORY, **fields) -> "EngineConfig":
        """kv_cache_memory: bytes, a size ("2GiB"), or "auto" (None: what the
        resident weights leave of the runner's AUTO_ENGINE_MEMORY_BYTES)."""
        size = None if kv_cache_memory == "auto" else parse_size(kv_cache_memory)
        return cls(kv_cache_memory_bytes=size, **fields)

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 tokens, got {self.max_model_len}")
        check_quantization(self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}; "
                             f"got {self.kv_cache_dtype!r}")
        if self.prefill_weights not in PREFILL_WEIGHTS_CHOICES:
            raise ValueError(f"prefill_weights must be one of {', '.join(PREFILL_WEIGHTS_CHOICES)}; "
                             f"got {self.prefill_weights!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}")


class StepResult(NamedTuple):
    """What one `EngineCore.step()` did."""

    outputs: list[RequestOutput]  # every request that got a token or finished
    scheduled: SchedulerOutput  # the batch that ran: its chunks, the requests it started and when
    captured_graph: bool  # the step captured a CUDA graph: its time holds that one-off cost
    # What the step's draft verifications did (None: speculation off).
    spec_decode: SpecDecodeCounts | None = None

    @property
    def num_decode_seqs(self) -> int:
        return self.scheduled.num_decode_seqs

    @property
    def num_prefill_tokens(self) -> int:
        return self.scheduled.num_prefill_tokens

    @property
    def started_ids(self) -> list[str]:
        """Requests scheduled for the first time (at `scheduled.scheduled_at`)."""
        return self.scheduled.started_ids

    @property
    def finished_ids(self) -> list[str]:
        return [o.request_id for o in self.outputs if o.finished]


class _RequestState:
    """Engine-side state of one unfinished request beside the scheduler's Request."""

    __slots__ = ("request", "detokenizer", "logprobs", "sampling")

    def __init__(self, request: Request, detokenizer: IncrementalDetokenizer) -> None:
        self.request = request
        self.detokenizer = detokenizer
        wants_logprobs = request.sampling_params.logprobs is not None
        self.logprobs: list[TokenLogprob] | None = [] if wants_logprobs else None
        # Grammar matcher and penalty counts, for requests that need them.
        self.sampling: SamplingState | None = None


class EngineCore:
    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor] | None, tokenizer: Tokenizer,
                 config: EngineConfig = EngineConfig(), *, versions: ResolvedVersions | None = None,
                 clock: Callable[[], float] = time.monotonic, runner=None) -> None:
        """runner: in place of the torch ModelRunner built from `weights`, any
        object with its `num_blocks`, `num_graph_captures` and `execute()`
        (`kvserve serve --simulate`: sim.simulated_runner.SimulatedRunner);
        with speculation it must be one that simulates it (a `draft_token_id`)."""
        placeholder = None if runner is None else getattr(runner, "draft_token_id", None)
        if runner is not None and config.speculative_config is not None and placeholder is None:
            raise ValueError("speculative decoding needs the model runner, or a simulated runner given an "
                             "acceptance rate (--spec-acceptance-rate)")
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.clock = clock
        self.max_model_len = min(model_config.max_position_embeddings,
                                 config.max_model_len or model_config.max_position_embeddings)
        # A draft model's weights load first: the target's cache is sized net of them.
        draft_runner = None if runner is not None else self._load_draft_runner(config.speculative_config)
        self.runner = runner if runner is not None else self._build_runner(weights, draft_runner)
        self.sleep_level = 0  # 0 awake; 1 KV cache freed, weights kept; 2 weights dropped too
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                            max_loras=config.max_loras if config.enable_lora else None),
            CacheConfig(num_blocks=self.runner.num_blocks, block_size=config.block_size,
                        enable_prefix_caching=config.enable_prefix_caching),
            clock=clock)
        self.versions = versions
        # The prefix-cache namespace names the weights: KV computed by other
        # weights must never be reused.
        self.requests = RequestFactory(tokenizer.eos_token_ids,
                                       versions.model_revision if versions is not None else "", clock)
        self._states: dict[str, _RequestState] = {}
        # The subset of running requests that the sampler keeps state for.
        self._sampling_states: dict[str, SamplingState] = {}
        # Requests whose grammar is still compiling: not yet in the scheduler.
        self._compiling: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        # Structured outputs: compiled off the engine thread, cached per schema.
        # The server may `submit` a request's constraint before adding it.
        self.structured = GrammarCompiler(tokenizer, model_config.vocab_size)
        # LoRA adapters by name; the runner's slots free an adapter's slot once
        # no name and no request refers to it.
        # (a simulated runner, server/simulated.py, has no slots: its adapters are names and ids)
        slots = self.lora_slots = getattr(self.runner, "lora_slots", None)
        self.adapters = AdapterRegistry(on_dropped=None if slots is None else slots.evict)
        self.speculator = None if config.speculative_config is None else Speculator(
            config.speculative_config, self.scheduler,
            None if draft_runner is None else self._draft_model(draft_runner), placeholder)

    def _load_draft_runner(self, config: SpeculativeConfig | None) -> ModelRunner | None:
        """The draft model's runner (speculation by draft_model), None otherwise."""
        if config is None or config.method != "draft_model":
            return None
        from kvserve.runner.draft_model import DraftModelProposer

        return DraftModelProposer.load_runner(config, block_size=self.config.block_size, dtype=self.config.dtype,
                                              device=self.config.device, max_model_len=self.max_model_len,
                                              quantization=self.config.quantization)

    def _draft_model(self, draft_runner: ModelRunner) -> DraftModelProposer:
        from kvserve.runner.draft_model import DraftModelProposer

        proposer = DraftModelProposer(draft_runner, self.runner, self.scheduler)
        target, draft = self.runner, proposer.draft
        target_bytes = target.num_blocks * kv_bytes_per_block(target.config, target.block_size, target.kv_dtype)
        draft_bytes = draft.num_blocks * kv_bytes_per_block(draft.config, draft.block_size, draft.kv_dtype)
        log.info("KV cache budget %.1f MiB shared by the target and its draft model: target %.1f MiB, draft "
                 "%.1f MiB, %d blocks of %d tokens each", target.kv_cache_memory_bytes / 2**20, target_bytes / 2**20,
                 draft_bytes / 2**20, target.num_blocks, target.block_size)
        return proposer

    def _build_runner(self, weights: dict[str, torch.Tensor] | None, draft: ModelRunner | None) -> ModelRunner:
        """The target's runner. With a draft model, one KV budget pays for both
        caches (the draft's holds as many blocks, so the budget is split by
        bytes per block), and an automatic budget is what both models'
        resident weights leave."""
        config = self.config
        return ModelRunner(
            self.model_config, weights, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            block_size=config.block_size, dtype=config.dtype, device=config.device,
            max_model_len=self.max_model_len, seed=config.seed,
            max_num_seqs=config.max_num_seqs, enforce_eager=config.enforce_eager,
            quantization=config.quantization, prefill_weights=config.prefill_weights,
            batch_invariant=config.batch_invariant, kv_cache_dtype=config.kv_cache_dtype,
            max_loras=config.max_loras if config.enable_lora else None,
            max_lora_rank=config.max_lora_rank,
            extra_kv_bytes_per_block=0 if draft is None else draft.kv_bytes_per_block,
            extra_weight_bytes=0 if draft is None else draft.weight_bytes)

    # -- sleep and wake (vLLM's levels) ---------------------------------------
    def sleep(self, level: int) -> int:
        """Free the KV cache's memory (level 1: the weights stay, on CUDA in
        pinned host memory; level 2: the weights are dropped too) and empty
        the prefix cache, whose blocks it held. Only with no request
        unfinished (ValueError otherwise). Bytes freed from the device."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.has_unfinished():
            raise ValueError("cannot sleep with requests unfinished")
        if self.sleep_level:
            return 0
        self.scheduler.kv_cache.pool.reset_prefix_cache()
        release = getattr(self.runner, "release_kv_cache", None)  # a simulated runner holds no tensors
        freed = release() if release is not None else 0
        if level == 2 and release is not None:
            self.runner = None  # its weights go with it; wake_up builds a new one
        elif release is not None:
            freed += self.runner.offload_weights()
        if self._draft is not None:
            freed += self._draft.sleep()
        self.sleep_level = level
        return freed

    def wake_up(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Undo sleep: the KV cache allocated again (empty), the weights back
        on the device; after level 2, `weights` (the model's tensors, read
        again from its source) build the runner anew."""
        if not self.sleep_level:
            return
        if self.runner is None:
            if weights is None:
                raise ValueError("waking from level 2 needs the weights (they were dropped)")
            self.runner = self._build_runner(weights, None if self._draft is None else self._draft.draft)
        elif hasattr(self.runner, "allocate_kv_cache"):
            self.runner.restore_weights()
            self.runner.allocate_kv_cache()
        if self._draft is not None:
            self._draft.wake_up(self.runner)
        self.sleep_level = 0

    @property
    def _draft(self) -> DraftModelProposer | None:
        """Speculation's draft model, whose own KV cache sleeps with the target's."""
        return None if self.speculator is None else self.speculator.draft_model

    # -- requests in and out -------------------------------------------------
    def new_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                    request_id: str | None = None, arrival_time: float | None = None, priority: int = 0,
                    tenant: str = "default", deadline: float | None = None,
                    adapter_id: str | None = None) -> Request:
        """A Request for this engine (`RequestFactory.build`: its EOS tokens,
        clock and cache namespace, per adapter)."""
        return self.requests.build(prompt_token_ids, sampling_params, request_id=request_id,
                                   arrival_time=arrival_time, priority=priority, tenant=tenant, deadline=deadline,
                                   adapter_id=adapter_id)

    # -- LoRA adapters -------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> LoraAdapter:
        """Read a PEFT adapter folder and serve it as `name` (any thread).
        Raises LoraError (a bad folder) or ValueError (LoRA not enabled, the
        name is taken or is the base model's)."""
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters are not enabled on this engine (enable_lora / --enable-lora)")
        if self.lora_slots is None:  # a simulated runner: the adapter's name, rank and id, no weights
            adapter = read_lora_identity(name, path, self.config.max_lora_rank)
        else:
            adapter = read_lora_adapter(name, path, self.model_config, self.config.max_lora_rank)
        self.adapters.add(adapter)
        return adapter

    def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving `name` (requests already under it finish); False if unknown."""
        return self.adapters.remove(name) is not None

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError (engine unchanged) if its prompt has
        token ids outside the vocabulary or cannot fit the model's context, and
        InvalidParameter if its constraint is known not to compile. A request
        whose grammar is still compiling is queued once it is compiled; should
        that compile fail, the request finishes as aborted."""
        self.check_prompt(request.prompt_token_ids)
        params = request.sampling_params
        vocab_size = self.model_config.vocab_size
        if any(t >= vocab_size for t, _ in params.logit_bias):
            raise InvalidParameter("logit_bias", f"keys must be token ids in [0, {vocab_size})")
        state = _RequestState(request, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                              params.stop, skip_special_tokens=True))
        grammar = None if params.structured_output is None else self.structured.submit(params.structured_output)
        if request.adapter_id is not None:
            self.adapters.acquire(request.adapter_id)  # raises ValueError once unloaded
        if grammar is not None and not grammar.done():
            self._states[request.request_id] = state
            self._compiling[request.request_id] = (request, grammar)
            return
        try:
            self._start(state, grammar)  # raises InvalidParameter for a failed compile
        except InvalidParameter:
            self._release_adapter(request)
            raise

    def _start(self, state: _RequestState, grammar: Future[CompiledGrammar] | None) -> None:
        """Hand a request to the scheduler with its sampling state (grammar: a done future)."""
        request = state.request
        if grammar is not None or SamplingState.needed(request):
            state.sampling = SamplingState(None if grammar is None else grammar.result().matcher())
        self.scheduler.add_request(request)
        self._states[request.request_id] = state
        if state.sampling is not None:
            self._sampling_states[request.request_id] = state.sampling

    def _start_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar finished compiling; a failed compile
        finishes its request as aborted (its output says so)."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished():
            # Nothing else to run: wait a little for a compile instead of spinning.
            wait([future for _, future in self._compiling.values()], COMPILE_WAIT_S, FIRST_COMPLETED)
        failed = []
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            state = self._states[request_id]
            try:
                self._start(state, future)
            except InvalidParameter:
                del self._states[request_id]
                self._release_adapter(request)
                request.status = RequestStatus.FINISHED_ABORTED
                request.timestamps.finished = self.clock()
                failed.append(self._output(state, [], [], ""))
        return failed

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        num_tokens = len(prompt_token_ids)
        if num_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {num_tokens} tokens but the model's context is "
                             f"{self.max_model_len} tokens (prompt plus at least one output token)")
        vocab_size = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its KV; its final output, or None if unknown."""
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            compiling[0].status = RequestStatus.FINISHED_ABORTED
            compiling[0].timestamps.finished = self.clock()
            self._release_adapter(compiling[0])
            return self._output(self._states.pop(request_id), [], [], "")
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        if self.speculator is not None:
            self.speculator.forget([request_id])
        return self._output(self._pop_state(request_id), [], [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def _pop_state(self, request_id: str) -> _RequestState:
        self._sampling_states.pop(request_id, None)
        state = self._states.pop(request_id)
        self._release_adapter(state.request)
        return state

    def _release_adapter(self, request: Request) -> None:
        if request.adapter_id is not None:
            self.adapters.release(request.adapter_id)

    # -- what the serving loop asks of it ----------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's EOS token ids (what its requests stop on)."""
        return self.requests.eos_token_ids

    def weight_formats(self) -> dict[str, int]:
        """Resident weight bytes by storage format (float32, q4_1, ...)."""
        return self.runner.model.weight_formats()

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    # The engine's sizes, as the warm-up plans its steps (admission/warm_up.py).
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's element type as resolved ("float32", "bfloat16"); a
        simulated runner, which holds no tensors, answers its config's."""
        kv_dtype = getattr(self.runner, "kv_dtype", None)
        if kv_dtype is None:
            return self.config.dtype if self.config.kv_cache_dtype == "auto" else self.config.kv_cache_dtype
        return str(kv_dtype).removeprefix("torch.")

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def context_lengths(self) -> tuple[list[int], list[int]]:
        """Tokens of each running and each waiting request (Scheduler.context_lengths)."""
        return self.scheduler.context_lengths()

    @property
    def num_deferred(self) -> int:
        """Requests waiting outside the scheduler for their grammar to compile."""
        return len(self._compiling)

    def memory_bytes(self) -> dict[str, int]:
        """Resident bytes by kind: weights, kv_cache (the preallocated
        tensor) and workspace (ModelRunner.workspace_bytes), a draft model's included."""
        resident = self.runner.memory_bytes()
        if self._draft is not None:  # the draft's share of the process's memory, out of the workspace
            draft = self._draft.draft.memory_bytes()
            own = draft["weights"] + draft["kv_cache"]
            resident["weights"] += draft["weights"]
            resident["kv_cache"] += draft["kv_cache"]
            resident["workspace"] = max(0, resident["workspace"] - own)
        return resident

    def prefix_hit_tokens(self, request: Request) -> int:
        """Tokens of a request not yet added that the prefix cache would serve
        now (admission's projection); no state change."""
        return self.scheduler.prefix_hit_tokens(request)

    def set_step_limits(self, limits: StepLimits) -> None:
        """The limits the next step is built under (Scheduler.set_step_limits)."""
        self.scheduler.set_step_limits(*limits)

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no request holds and zero the prefix-cache
        and preemption totals (after a warm-up)."""
        self.scheduler.reset_prefix_cache()

    # -- the step ------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one forward pass: schedule -> execute -> update (after queueing the
        requests whose grammar finished compiling)."""
        failed = self._start_compiled()
        scheduled = self.scheduler.schedule()
        captures = self.runner.num_graph_captures
        # Each runner is called with what it takes: a simulated runner neither
        # drafts (speculation needs the model runner) nor adapters.
        extra: dict = {}
        speculator = self.speculator
        if speculator is not None:
            extra["draft_probs"] = speculator.draft_probs
            if speculator.placeholder_token_id is not None:  # a simulated runner prices the proposer too
                extra["num_draft_passes"] = speculator.num_draft_passes
        if self.lora_slots is not None:
            extra["adapters"] = self.adapters.by_id()
        sampled = self.runner.execute(scheduled, self._sampling_states, **extra)
        outputs = failed + self._process(scheduled, sampled)
        spec_decode = None
        if speculator is not None:
            spec_decode = speculator.count(scheduled, sampled)
            speculator.forget(o.request_id for o in outputs if o.finished)
            speculator.propose(self._sampling_states)
        return StepResult(outputs, scheduled, self.runner.num_graph_captures != captures, spec_decode)

    def _process(self, scheduled: SchedulerOutput, sampled: SamplerOutput) -> list[RequestOutput]:
        # Where each verifying request's output stood: it may gain several tokens.
        num_before = {c.request.request_id: c.request.num_output_tokens for c in scheduled.chunks
                      if c.spec_token_ids}
        progressed = self.scheduler.update(scheduled, sampled.token_ids,
                                           sampled.num_accepted if num_before else None)
        # Finished while scheduling (outgrew the whole KV cache): report with held-back text.
        outputs = []
        for request in scheduled.finished:
            state = self._pop_state(request.request_id)
            outputs.append(self._output(state, [], [], state.detokenizer.flush()))
        for request in progressed:
            rid = request.request_id
            start = num_before.get(rid)
            if start is None:
                outputs.append(self._emit(request, request.output_token_ids[-1:], [sampled.logprobs.get(rid)]))
                continue
            logprobs = [*sampled.accepted_logprobs.get(rid, ()), sampled.logprobs.get(rid)]
            outputs.append(self._emit(request, request.output_token_ids[start:], logprobs))
        return outputs

    def _emit(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> RequestOutput:
        """Stream the tokens the step appended to `request` (several when drafts
        were accepted) through its grammar and detokenizer; a stop string
        completed part-way ends the request there, the tokens after it dropped."""
        state = self._states[request.request_id]
        new_text = ""
        new_logprobs: list[TokenLogprob] = []
        stopped = False
        for index, token_id in enumerate(token_ids):
            if state.sampling is not None and state.sampling.grammar is not None:
                self._advance_grammar(request, state.sampling, token_id)
            delta = state.detokenizer.push(token_id)
            new_text += delta.new_text
            logprob = logprobs[index] if index < len(logprobs) else None
            if state.logprobs is not None and logprob is not None:
                state.logprobs.append(logprob)
                new_logprobs.append(logprob)
            if delta.stopped:
                stopped = True
                _drop_last_tokens(request, len(token_ids) - index - 1)
                token_ids = token_ids[:index + 1]
                break
        if stopped and request.is_finished:
            # Hit max_tokens on the same token that completed a stop string: the
            # text ends at the stop string, so the reason is "stop" (already freed).
            request.status = RequestStatus.FINISHED_STOPPED
        elif stopped:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif request.is_finished:
            new_text += state.detokenizer.flush()  # text held back for a stop string that never came
        if request.is_finished:
            self._pop_state(request.request_id)
        return self._output(state, token_ids, new_logprobs if state.logprobs is not None else [], new_text)

    def _advance_grammar(self, request: Request, sampling: SamplingState, token_id: int) -> None:
        """Advance the constraint by the sampled token; once the constraint is
        complete the request finishes with "stop" (its output then parses)."""
        assert sampling.grammar is not None
        accepted = sampling.grammar.accept(token_id)
        if request.is_finished:
            if accepted and sampling.grammar.is_finished and request.status == RequestStatus.FINISHED_LENGTH:
                request.status = RequestStatus.FINISHED_STOPPED  # its last token completed the constraint
            return
        if not accepted:
            # The mask allowed only grammar tokens, so this is the grammar
            # engine's fault; never call such an output "stop".
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
        elif sampling.grammar.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    @staticmethod
    def _output(state: _RequestState, new_token_ids: list[int], new_logprobs: list[TokenLogprob],
                new_text: str) -> RequestOutput:
        request = state.request
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            text=state.detokenizer.text, new_text=new_text, token_ids=list(request.output_token_ids),
            new_token_ids=new_token_ids, finished=request.is_finished, finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens, timestamps=request.timestamps,
            logprobs=None if state.logprobs is None else list(state.logprobs),
            new_logprobs=None if state.logprobs is None else new_logprobs)


def _drop_last_tokens(request: Request, num_tokens: int) -> None:
    """Undo the last `num_tokens` appended outputs (accepted drafts after a
    stop string): the request ends at the stop string's token."""
    if num_tokens:
        del request.output_token_ids[-num_tokens:]
        del request.timestamps.token_times[-num_tokens:]
