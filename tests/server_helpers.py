"""A live kvserve server on 127.0.0.1 with a tiny random-weight model, for the
server tests: uvicorn in a background thread, a byte-level tokenizer whose 256
tokens match the tiny model's vocabulary."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import uvicorn
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvserve.admission.tenants import TenantDirectory
from kvserve.config import AdmissionConfig, ServerConfig
from kvserve.contract import ResolvedVersions
from kvserve.engine.core import EngineConfig, EngineCore
from kvserve.model_facts.tokenizer import Tokenizer
from kvserve.server.app import create_app
from kvserve.server.serving import Serving
from kvserve.server.transport import ConnectionLimits, uvicorn_config
from tests.tiny_models import model_config_of, tiny_llama, weights_of

MODEL_NAME = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
# Tiny llama: 2 layers x (K + V) x 2 KV heads x head_dim 16 x 4 bytes = 512 bytes per token.
KV_BYTES_PER_TOKEN = 512


def byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, [], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=CHAT_TEMPLATE)


_HF_MODEL = None


def tiny_core(num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 16,
              max_num_batched_tokens: int = 256, max_model_len: int = 512,
              speculative_config: dict | None = None, **engine_fields) -> EngineCore:
    """An EngineCore over tiny_llama(seed=0) (`engine_fields`: more EngineConfig fields)."""
    global _HF_MODEL
    if _HF_MODEL is None:
        _HF_MODEL = tiny_llama(seed=0)
    tokenizer = byte_tokenizer()
    versions = ResolvedVersions("tinyrev0123456789", tokenizer.content_hash(), tokenizer.chat_template_hash())
    config = EngineConfig(kv_cache_memory_bytes=num_blocks * block_size * KV_BYTES_PER_TOKEN,
                          block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, device="cpu",
                          max_model_len=max_model_len, speculative_config=speculative_config, **engine_fields)
    core = EngineCore(model_config_of(_HF_MODEL), weights_of(_HF_MODEL), tokenizer, config, versions=versions)
    core.versions = versions
    return core


def slow_steps(core: EngineCore, delay_s: float) -> EngineCore:
    """Make every engine step of `core` take at least `delay_s` longer, so a
    test's long request stays in flight for a known time however fast the
    machine runs the tiny model."""
    if delay_s <= 0:
        return core
    step = core.step

    def slow_step():
        time.sleep(delay_s)
        return step()
    core.step = slow_step
    return core


class LiveServer:
    """uvicorn on 127.0.0.1:<free port> in a thread, set up as `kvserve serve`
    sets it up (bounded, watched connections); use as a context manager."""

    def __init__(self, serving: Serving, limits: ConnectionLimits | None = None) -> None:
        self.serving = serving
        limits = limits or ConnectionLimits(serving.config.stream_stall_timeout_s)
        config = uvicorn_config(create_app(serving), "127.0.0.1", 0, limits,
                                log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def live_server(core: EngineCore | None = None, tenants: TenantDirectory | None = None,
                **admission) -> LiveServer:
    server_fields = {k: admission.pop(k) for k in list(admission) if k in ServerConfig.__dataclass_fields__}
    server_config = replace(ServerConfig(served_model_name=MODEL_NAME), **server_fields)
    serving = Serving(core or tiny_core(), AdmissionConfig(**admission), server_config, tenants)
    return LiveServer(serving)
