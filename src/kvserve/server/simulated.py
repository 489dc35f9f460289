"""`kvserve serve --simulate`: the real server, admission and scheduler with
the simulator's cost model in place of the torch runner, on the wall clock
(kvserve.sim.simulated_runner). No weights are loaded: the model is a
preset's or a model file's configuration, the tokenizer is that model's
(the embedded SmolLM2's for a preset), and the hardware is a preset's
roofline or a `kvserve profile` JSON, as in `kvserve simulate`.

LoRA adapters (`--lora-modules NAME=PATH`, POST /v1/load_lora_adapter) are
served by name as on a real server: listed in /v1/models, chosen by a
request's `model`, counted by admission, the scheduler's --max-loras and
/metrics, an unknown name refused with 404. Only the folder's
adapter_config.json is read (its rank; the id hashes its files), no weights.
A step under adapters costs what the base model's step of that shape costs:
neither cost model has an adapter term, and on the accelerators they
model a rank-16 adapter on every projection adds ~0.6% to a 7B layer's
weight read and FLOPs per distinct adapter (on this project's CPU, where the base model
is 135M parameters and quantized, the real figure is larger: see
benchmarks/multi_lora.py).

Speculative decoding is simulated as in `kvserve simulate` too
(--speculative-config with --spec-acceptance-rate, --spec-proposer-cost-ms):
the engine's speculator and policy, drafts' fates drawn by the runner,
spec_decode metrics as a live server's."""

from __future__ import annotations

import argparse
from dataclasses import replace

from kvserve import flags

ROOFLINE_DEFAULTS = {"memory": None, "reserve": "10%", "compute_efficiency": 0.5, "bandwidth_efficiency": 0.8,
                     "step_overhead_ms": 2.0, "kv_dtype": "bfloat16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("simulated replica (--simulate)")
    group.add_argument("--simulate", action="store_true",
                       help="serve with the simulator's cost model instead of the model: each engine step "
                            "sleeps its modelled time and emits words of a fixed vocabulary (no weights, "
                            "next to no CPU); for fleets of replicas on one machine")
    group.add_argument("--preset", default=None,
                       help="with --simulate: a named architecture (see kvserve plan) instead of --model")
    group.add_argument("--hardware", default="h100",
                       help="with --simulate: accelerator preset (h100, h200, a100, l4) for a roofline cost "
                            "model, or a profile JSON from `kvserve profile`")
    flags.add_simulated_speculation_arguments(group)


def build_core(args: argparse.Namespace, config=None):
    """(EngineCore with a SimulatedRunner, versions, served model name);
    config: the EngineConfig (default: engine_config(args))."""
    from kvserve.contract import ResolvedVersions
    from kvserve.engine.cli import engine_config
    from kvserve.engine.core import EngineCore
    from kvserve.model_facts.default_model import default_model_path
    from kvserve.model_facts.source import load_tokenizer
    from kvserve.plan.presets import resolve_model
    from kvserve.sim.cli import cost_model_and_num_blocks, sim_speculation
    from kvserve.sim.simulated_runner import SimulatedRunner, word_vocabulary

    model_path = args.model if args.model or args.preset else str(default_model_path())
    spec = resolve_model(args.preset, model_path if args.preset is None else None)
    sizing = argparse.Namespace(**{**ROOFLINE_DEFAULTS, "hardware": args.hardware, "dtype": None,
                                   "kv_cache_memory": args.kv_cache_memory, "block_size": args.block_size,
                                   "speculative_config": args.speculative_config})
    cost_model, num_blocks = cost_model_and_num_blocks(sizing, spec)
    tokenizer = load_tokenizer(args.model if args.preset is None else None)
    excluded = set(tokenizer.eos_token_ids) | set(tokenizer.special_token_ids)
    speculation = sim_speculation(args, seed=getattr(args, "seed", None) or 0)
    runner = SimulatedRunner(cost_model, num_blocks, word_vocabulary(tokenizer.encode, excluded),
                             speculation=speculation)
    # Its KV memory and dtype size no tensor (the runner is simulated); the
    # speculation's config is the one parsed with its defaults.
    config = engine_config(args) if config is None else config
    config = replace(config, speculative_config=None if speculation is None else speculation.config)
    versions = ResolvedVersions(f"sim-{spec.name}-{args.hardware}", tokenizer.content_hash(),
                                tokenizer.chat_template_hash())
    core = EngineCore(spec.config, None, tokenizer, config, versions=versions, runner=runner)
    return core, versions, spec.name
