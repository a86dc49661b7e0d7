"""The full-run configuration: typed, frozen sections loaded with ``pdm_lab.config``.

One schema for every run, tiny CPU or 30B: the ``mask:`` section is ``pdm_lab.mask_config.MaskConfig``,
the same type the toy sweeps use, so a promoted toy configuration drops in unchanged. Unknown keys
are errors naming the nearest valid key (``pdm_lab.config.from_dict``). Defaults follow the paper's
setup (SPEC §7) where it states one; the tiny config overrides what a CPU can afford.

One module of ~530 lines on purpose, as TRL's ``GRPOConfig`` is: the whole run's schema reads in
one place, and most lines are the fields' one-line docs (a field without its doc is a defect here).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

# the ``audit:`` section (SPEC §6c) is the core's, shared with the TRL trainer's audit
from pdm_lab.audit.live import LiveAuditConfig as AuditConfig
from pdm_lab.config import ConfigError, at_least, config_dataclass, from_dict, in_range, non_negative, one_of, positive, to_dict
from pdm_lab.mask_config import MaskConfig
from pdm_lab.masks import MASK_RULES
from pdm_lab.lab.wandb_log import WandbConfig
from pdm_lab.lab.yaml_config import apply_overrides, dump_yaml, read_yaml

PRECISIONS = ("fp32", "bf16", "fp8")
TRAIN_DTYPES = ("fp32", "bf16")


@config_dataclass("model.tiny")
class TinyModelConfig:
    """A random Qwen3 built locally (CPU tests and the tiny run)."""

    hidden_size: Annotated[int, at_least(1)] = 64
    """Model width."""
    num_hidden_layers: Annotated[int, at_least(1)] = 2
    """Decoder layers."""
    num_attention_heads: Annotated[int, at_least(1)] = 4
    """Query heads."""
    num_key_value_heads: Annotated[int, at_least(1)] = 2
    """KV heads (GQA)."""
    head_dim: Annotated[int, at_least(1)] = 32
    """Per-head width; vLLM's CPU attention supports 32, 64, 80, ... (not 16)."""
    intermediate_size: Annotated[int, at_least(1)] = 128
    """MLP width."""
    vocab_size: Annotated[int, at_least(2)] = 512
    """Embedding (model id) size; the tokenizer's real vocabulary may be smaller (Qwen3: 151,936
    ids, ~151.7k tokens); the ids it never emits get only the tied head's push-down: the tail of μ."""
    tokenizer_vocab_size: Annotated[int, at_least(2)] | None = None
    """Tokens the byte-level BPE learns (None: ``vocab_size``); at most ``vocab_size``."""
    max_position_embeddings: Annotated[int, at_least(2)] = 256
    """Longest prompt + response."""
    init_std: Annotated[float, positive] = 0.02
    """Initialiser standard deviation."""
    tie_word_embeddings: bool = False
    """Share the input embedding with ``lm_head`` (as Qwen3 0.6B/1.7B/4B do); the weight sync
    must then still push ``lm_head.weight``, which vLLM on CPU packs separately."""
    seed: int = 0
    """Seed of the weights and the warm-up batches."""
    sft_steps: Annotated[int, at_least(0)] = 400
    """Supervised warm-up steps on the task before RL (0: none; gives LLM-like peaked π)."""
    sft_lr: Annotated[float, positive] = 3e-3
    """Warm-up peak learning rate (cosine to 10%)."""
    sft_batch_size: Annotated[int, at_least(1)] = 64
    """Warm-up batch size."""
    sft_noise: Annotated[float, in_range(0.0, 1.0, high_open=True)] = 0.0
    """Fraction of warm-up answers with one character replaced at random: the warmed-up policy
    is then right only part of the time at temperature 1 (as a base LLM is), and RL has
    something to sharpen."""

    def __post_init__(self) -> None:
        if self.tokenizer_vocab_size is not None and self.tokenizer_vocab_size > self.vocab_size:
            raise ConfigError(f"model.tiny.tokenizer_vocab_size ({self.tokenizer_vocab_size}) exceeds "
                              f"vocab_size ({self.vocab_size}): every token needs an embedding row")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"model.tiny.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                              f"of num_key_value_heads ({self.num_key_value_heads}): each KV head serves a "
                              "group of query heads")


@config_dataclass("model")
class ModelConfig:
    """The policy: a local Hugging Face directory, or a tiny model built on first use."""

    path: str | None = None
    """Local directory with config.json, tokenizer and safetensors (never a hub id)."""
    tiny: TinyModelConfig | None = None
    """Build a tiny random Qwen3 instead of reading ``path``."""

    def __post_init__(self) -> None:
        if (self.path is None) == (self.tiny is None):
            raise ConfigError("model: set exactly one of model.path (a local directory) or model.tiny")


@config_dataclass("data.synthetic")
class SyntheticTaskConfig:
    """A synthetic verifiable task written to JSONL in the cache (``scaling/tasks.py``)."""

    name: str = "add"
    """Task: add, copy, reverse, sort."""
    n_train: Annotated[int, at_least(1)] = 4000
    """Training prompts."""
    n_eval: Annotated[int, at_least(0)] = 128
    """Held-out evaluation prompts (disjoint from training)."""
    seed: int = 1234
    """Seed of the generated prompts."""
    max_value: Annotated[int, at_least(1)] = 100
    """``add``: operands in [0, max_value)."""
    length: Annotated[int, at_least(1)] = 3
    """copy/reverse/sort: digits per prompt (length − 1 to length)."""

    def __post_init__(self) -> None:
        from .tasks import TASKS

        one_of("data.synthetic.name", self.name, TASKS)


@config_dataclass("data")
class DataConfig:
    """Prompt files (JSONL or parquet) and how to read a row."""

    train_files: tuple[str, ...] = ()
    """Training prompt files (.jsonl / .parquet), relative to the working directory."""
    eval_files: tuple[str, ...] = ()
    """Held-out sets; each reported as ``eval/<file stem>/avg@k``."""
    prompt_key: str = "prompt"
    """Row field with the prompt: a string, or a chat message list [{role, content}]. Dots nest."""
    answer_key: str = "answer"
    """Row field with the reference answer; dots nest (DAPO parquet: reward_model.ground_truth)."""
    prompt_template: str = "{prompt}"
    """Applied to string prompts before the chat template; ``{prompt}`` is the row's text."""
    eval_prompt_key: str | None = None
    """prompt_key for the eval files when their schema differs (AIME sets: ``problem``)."""
    eval_answer_key: str | None = None
    """answer_key for the eval files (None: same as answer_key)."""
    eval_prompt_template: str | None = None
    """prompt_template for the eval files (None: same as prompt_template)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (add_generation_prompt=True)."""
    max_prompt_tokens: Annotated[int, at_least(1)] = 1024
    """Longer prompts are dropped at load time (counted and reported)."""
    on_bad_row: str = "error"
    """A row that cannot be read: ``error`` (stop, naming file and line) or ``skip`` (log, count)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (seeded)."""
    synthetic: SyntheticTaskConfig | None = None
    """Generate a synthetic task instead of reading train_files/eval_files."""

    def __post_init__(self) -> None:
        one_of("data.on_bad_row", self.on_bad_row, ("error", "skip"))
        if self.synthetic is None and not self.train_files:
            raise ConfigError("data: give data.train_files or data.synthetic")
        for name in ("prompt_template", "eval_prompt_template"):
            value = getattr(self, name)
            if value is not None and "{prompt}" not in value:
                raise ConfigError(f"data.{name}: must contain {{prompt}}")

    def for_eval(self) -> "DataConfig":
        """This section with the eval-specific keys and template in force."""
        return dataclasses.replace(
            self, prompt_key=self.eval_prompt_key or self.prompt_key,
            answer_key=self.eval_answer_key or self.answer_key,
            prompt_template=self.eval_prompt_template or self.prompt_template)


@config_dataclass("rollout")
class RolloutConfig:
    """The vLLM behaviour policy μ. K (log-probs per token) is ``mask.k``."""

    prompts_per_step: Annotated[int, at_least(1)] = 256
    """Prompts per RL step, over all ranks (paper recipe: 256)."""
    group_size: Annotated[int, at_least(2)] = 16
    """G, samples per prompt (GRPO group; paper recipe: 16); ≥ 2, since advantages are normalised
    within the group (one sample's advantage is always 0)."""
    temperature: Annotated[float, positive] = 1.0
    """Sampling temperature; π is computed at the same temperature (SPEC §1)."""
    top_p: Annotated[float, in_range(0.0, 1.0, low_open=True)] = 1.0
    """Nucleus sampling (1.0: off). Cut tokens come back as −inf processed log-probs."""
    top_k: Annotated[int, at_least(-1)] = -1
    """Top-k sampling (−1: off)."""
    min_p: Annotated[float, in_range(0.0, 1.0)] = 0.0
    """Min-p sampling (0: off)."""
    keep_sampling_mask: bool | None = None
    """π over the tokens the engine could sample (its top-k/top-p/min-p cut reproduced on the
    trainer's logits), renormalised, so the cut is no mismatch (SPEC §1, ``pdm_lab.sampling_mask``);
    None: on whenever one of those cuts is set."""
    max_tokens: Annotated[int, at_least(1)] = 8192
    """Response budget."""
    precision: str = "fp32"
    """Weights pushed to vLLM: fp32, bf16, or fp8 (e4m3, block-wise scales)."""
    fp8_mode: str = "simulate"
    """fp8 only: ``simulate`` (quantise-dequantise the pushed weights; any device) or ``native``
    (vLLM's own FP8 kernels, ``quantization="fp8"``; GPU only, untested here)."""
    fp8_block: Annotated[int, at_least(1)] = 128
    """fp8 only: block size of the block-wise scales (DeepSeek-V3 style 128×128)."""
    fp8_activations: str = "none"
    """fp8 simulate only: also round the input of every quantised Linear to e4m3 in the engine
    (W8A8, dynamic scale amax/448): ``per_token`` (one scale per token row), ``per_tensor`` (one per
    forward call: μ then depends on the batch) or ``none`` (weights only). Needs ``enforce_eager``
    (the rounding runs in forward pre-hooks on vLLM's Linear modules, ``scaling.fp8``)."""
    tensor_parallel_size: Annotated[int, at_least(1)] = 1
    """vLLM tensor parallelism inside each data-parallel group (ranks per engine)."""
    kv_cache_gib: Annotated[float, positive] = 0.25
    """KV-cache memory per engine (CPU needs it set; on GPU ``gpu_memory_utilization`` rules)."""
    gpu_memory_utilization: Annotated[float, in_range(0.0, 1.0, low_open=True)] = 0.5
    """GPU only: fraction of device memory vLLM may take (colocated with the trainer)."""
    enforce_eager: bool = True
    """No compilation / CUDA graphs (fast start; CPU needs it for a quick tiny run)."""
    inplace_sync: bool = True
    """CPU: the engine computes its linear layers from unpacked weights that the weight sync
    overwrites in place (no oneDNN repacking per step); false: vLLM's ``reload_weights``, which
    repacks every layer each sync but decodes with packed kernels (may pay off on large models)."""
    enable_prefix_caching: bool = False
    """Prefix cache (reset after every weight sync either way)."""
    max_num_seqs: Annotated[int, at_least(1)] = 256
    """vLLM scheduler batch limit."""
    max_model_len: Annotated[int, at_least(2)] | None = None
    """Context length (default: longest prompt + max_tokens)."""
    seed: int = 0
    """Offset added to the run seed for sampling seeds (per step, per rank, per prompt)."""

    def __post_init__(self) -> None:
        one_of("rollout.precision", self.precision, PRECISIONS)
        one_of("rollout.fp8_mode", self.fp8_mode, ("simulate", "native"))
        one_of("rollout.fp8_activations", self.fp8_activations, ("none", "per_token", "per_tensor"))  # scaling.fp8.ACTIVATION_MODES
        if self.fp8_activations != "none":
            if self.precision != "fp8" or self.fp8_mode != "simulate":
                raise ConfigError(f"rollout.fp8_activations: {self.fp8_activations} needs rollout.precision: fp8 "
                                  f"with rollout.fp8_mode: simulate (got {self.precision}"
                                  f"{', ' + self.fp8_mode if self.precision == 'fp8' else ''})")
            if not self.enforce_eager:
                raise ConfigError("rollout.fp8_activations needs rollout.enforce_eager: true (its forward "
                                  "pre-hooks are not part of a graph vLLM compiled before they were added)")
        if self.keep_sampling_mask not in (None, True, False):
            raise ConfigError(f"rollout.keep_sampling_mask: true, false or null, got {self.keep_sampling_mask!r}")

    @property
    def sampling_mask(self):
        """The ``SamplingMask`` the trainer applies to π, or None (kept off, or nothing cut)."""
        from pdm_lab.sampling_mask import SamplingMask

        mask = SamplingMask(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)
        return mask if mask.active and self.keep_sampling_mask is not False else None


@config_dataclass("trainer")
class TrainerConfig:
    """FSDP2 trainer and optimiser (one PPO epoch per rollout batch, SPEC §7)."""

    lr: Annotated[float, in_range(0.0, 1.0, low_open=True)] = 1e-6
    """AdamW learning rate (paper recipe: 1e-6); above 1 every step overshoots."""
    weight_decay: Annotated[float, non_negative] = 0.0
    """AdamW weight decay."""
    betas: Annotated[tuple[float, ...], in_range(0.0, 1.0, high_open=True)] = (0.9, 0.999)
    """AdamW betas."""
    eps: Annotated[float, positive] = 1e-8
    """AdamW epsilon."""
    warmup_steps: Annotated[int, at_least(0)] = 0
    """Linear learning-rate warm-up in optimiser steps."""
    grad_clip: Annotated[float, positive] | None = 1.0
    """Global gradient-norm clip (None: off)."""
    mini_batches: Annotated[int, at_least(1)] = 8
    """Optimiser steps per rollout batch (paper recipe: 8); one pass over the data."""
    micro_batch_size: Annotated[int, at_least(1)] = 4
    """Sequences per forward/backward on each rank (gradient accumulation inside a mini-batch)."""
    param_dtype: str = "fp32"
    """Compute dtype of the trainer (FSDP MixedPrecisionPolicy); master weights stay fp32."""
    reduce_dtype: str = "fp32"
    """Gradient reduce-scatter dtype."""
    logits_chunk_tokens: Annotated[int, at_least(1)] | None = None
    """Compute lm_head + π on the support this many tokens at a time, recomputing in backward,
    so no [N, V] logits tensor lives across the step (None: one chunk)."""
    gradient_checkpointing: bool = False
    """Recompute decoder layers in backward."""
    max_nonfinite_steps: Annotated[int, at_least(1)] = 3
    """Consecutive steps with a non-finite loss or gradient (their optimiser steps skipped) that stop
    the run, exit status 3 (docs/guide/hardening.md)."""

    def __post_init__(self) -> None:
        one_of("trainer.param_dtype", self.param_dtype, TRAIN_DTYPES)
        one_of("trainer.reduce_dtype", self.reduce_dtype, TRAIN_DTYPES)
        if len(self.betas) != 2:
            raise ConfigError(f"trainer.betas: expected two numbers, got {list(self.betas)}")


@config_dataclass("algo")
class AlgoConfig:
    """Advantages (GRPO group normalisation)."""

    norm_by_std: bool = True
    """Divide by the group's standard deviation (GRPO); False: mean-centred only (Dr. GRPO)."""
    std_eps: Annotated[float, non_negative] = 1e-6
    """Added to the standard deviation."""


@config_dataclass("reward")
class RewardConfig:
    """The verifier that scores a response against the row's answer."""

    verifier: str = "math"
    """``math`` (boxed / "Answer:" extraction + equivalence), ``exact``, or ``module:function``."""
    on_error: str = "skip"
    """If the verifier raises: ``skip`` (sample leaves the loss, logged) or ``error`` (stop)."""

    def __post_init__(self) -> None:
        one_of("reward.on_error", self.on_error, ("skip", "error"))
        from .verifiers import get_verifier

        get_verifier(self.verifier)  # an unknown name is a ConfigError naming reward.verifier


@config_dataclass("eval")
class EvalConfig:
    """Periodic evaluation: avg@k accuracy on the held-out prompts."""

    every: Annotated[int, at_least(0)] = 10
    """Evaluate every this many steps (0: never); also before the first step if ``at_start``."""
    k: Annotated[int, at_least(1)] = 16
    """Samples per prompt (avg@k; paper: AIME avg@16)."""
    temperature: Annotated[float, positive] = 1.0
    """Evaluation sampling temperature."""
    max_tokens: Annotated[int, at_least(1)] | None = None
    """Response budget (default: rollout.max_tokens)."""
    max_prompts: Annotated[int, at_least(1)] | None = None
    """Evaluate only the first this many prompts per set (None: all)."""
    at_start: bool = True
    """Also evaluate the initial policy (step 0)."""


@config_dataclass("checkpoint")
class CheckpointConfig:
    """torch.distributed.checkpoint snapshots with exact resume."""

    every: Annotated[int, at_least(0)] = 10
    """Save every this many steps (0: only at the end)."""
    keep_last: Annotated[int, at_least(1)] = 2
    """Complete checkpoints to keep."""
    resume: str = "auto"
    """``auto`` (latest complete checkpoint of run_dir, if any), ``never``, or a checkpoint path."""


@config_dataclass("log")
class LogConfig:
    """Metrics output (JSONL always, TensorBoard and W&B optionally) and the weight-sync check."""

    tensorboard: bool = True
    """Also write TensorBoard event files under run_dir/tb."""
    sync_check_every: Annotated[int, at_least(0)] = 10
    """Every this many steps, score a fixed sequence with vLLM after the sync and compare with
    the trainer's log-probs (``sync/logp_max_abs_err``); the run stops with an error naming the
    step when they differ by more than ``sync_check_tol``. Also checked once before the first
    step. 0: only that first check."""
    sync_check_tol: Annotated[float, positive] | None = None
    """Largest tolerated max |log μ − log π| (None: 32 ulps of the coarser of the engine and
    trainer dtypes times (1 + max |log π|); off for fp8 rollouts, whose mismatch is intended)."""
    print_every: Annotated[int, at_least(1)] = 1
    """Progress line every this many steps."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases (``pdm_lab.lab.wandb_log``): off by default; ``log.wandb.mode=offline``
    or a ``project`` turns it on (offline unless ``mode: online``)."""


@config_dataclass("launch")
class LaunchConfig:
    """How ``pdm-lab train`` starts the ranks when not already under torchrun."""

    nproc_per_node: Annotated[int, at_least(0)] = 0
    """Ranks to start on this machine (each holds an FSDP shard and a vLLM engine); 0: one per
    GPU, or one on a CPU host (``distributed.default_ranks``)."""
    threads_per_rank: Annotated[int, at_least(0)] = 0
    """torch intra-op threads per rank; 0: the cores per rank, capped at one per 256 hidden
    units (``distributed.threads_per_rank``: a tiny model runs fastest on one thread)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl with CUDA, else gloo), gloo, nccl."""

    def __post_init__(self) -> None:
        one_of("launch.backend", self.backend, ("auto", "gloo", "nccl"))


@config_dataclass("provenance")
class Provenance:
    """Where a promoted configuration came from (written by ``pdm-lab promote``)."""

    sweep_dir: str = ""
    """The toy sweep directory."""
    cell_id: str = ""
    """The chosen cell."""
    criterion: str = ""
    """How it was chosen."""
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The chosen cell's metric values (means over seeds)."""
    code_version: str = ""
    """git describe of the code that promoted it."""
    base_config: str = ""
    """The base config the mask section was put into."""
    created: str = ""
    """UTC timestamp."""


@config_dataclass("")
class TrainConfig:
    """A full RL run: prompts → vLLM → verifier → GRPO advantages → FSDP2 + PDM loss → sync."""

    model: ModelConfig
    """The policy (required)."""
    data: DataConfig
    """Prompts and answers (required)."""
    name: str = "run"
    """Run name (TensorBoard tag, default run_dir)."""
    run_dir: str | None = None
    """Output directory (metrics, checkpoints, resolved config); default runs/<name>."""
    seed: int = 0
    """Seed of data order, sampling and initialisation of anything random."""
    total_steps: Annotated[int, at_least(1)] = 100
    """RL steps (one rollout batch each)."""
    plugins: tuple[str, ...] = ()
    """Modules imported before anything else (to register mask rules or verifiers)."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """The vLLM behaviour policy."""
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    """FSDP2 trainer and optimiser."""
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    """Advantages."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """Verifier."""
    mask: MaskConfig = dataclasses.field(default_factory=MaskConfig)
    """The trust-region mask and loss: the same type as the toy sweeps' (pdm_lab.config)."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Periodic evaluation."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    """Metrics output."""
    launch: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)
    """Local process launch."""
    audit: AuditConfig = dataclasses.field(default_factory=AuditConfig)
    """The direction audit on live batches (off by default)."""
    provenance: Provenance | None = None
    """Set by ``pdm-lab promote``; informational."""

    def __post_init__(self) -> None:
        from pdm_lab.lab.outputs import check_name

        check_name(self.name, "name")  # runs/<name> stays inside runs/
        kernel_rules = [("mask.rule", self.mask.rule)] if "kernel" in self.mask.rule_record.needs else []
        if self.audit.every:
            kernel_rules += [(f"audit.rules[{i}]", r) for i, r in enumerate(self.audit.rules)
                             if "kernel" in MASK_RULES[r].needs]
        if kernel_rules and self.rollout.sampling_mask is not None:  # h_t is the full softmax's (train_step)
            where, rule = kernel_rules[0]
            raise ConfigError(f"rollout.keep_sampling_mask: {where} {rule!r} computes h_t = ⟨Wᵀg, Wᵀv⟩ on the full "
                              "softmax, not on the engine's sampling set; set rollout.keep_sampling_mask: false "
                              "or sample without a top-k/top-p/min-p cut")
        if self.audit.every:  # an index past the step's mini-batches audits nothing
            self.audit.mini_batches(self.trainer.mini_batches)
        samples = self.rollout.prompts_per_step * self.rollout.group_size
        if self.trainer.mini_batches > samples:  # an empty mini-batch is no optimiser step
            raise ConfigError(f"trainer.mini_batches: {self.trainer.mini_batches} exceeds the samples per step "
                              f"(rollout.prompts_per_step × rollout.group_size = {samples})")
        tiny = self.model.tiny
        if tiny is not None and self.mask.k > tiny.vocab_size:  # K tokens of a smaller vocabulary
            raise ConfigError(f"mask.k: {self.mask.k} exceeds the vocabulary (model.tiny.vocab_size = "
                              f"{tiny.vocab_size})")
        if tiny is not None:  # a model read from model.path is checked by the dry run / preflight
            budget = max(self.rollout.max_tokens, self.eval.max_tokens or 0)
            context = max(self.rollout.max_model_len or 0, budget + 1)  # at least one prompt token
            if context > tiny.max_position_embeddings:
                raise ConfigError(f"model.tiny.max_position_embeddings ({tiny.max_position_embeddings}) is "
                                  f"shorter than a prompt plus the response budget (rollout.max_tokens = "
                                  f"{self.rollout.max_tokens}, eval.max_tokens = {self.eval.max_tokens}, "
                                  f"rollout.max_model_len = {self.rollout.max_model_len})")

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Load a TrainConfig from YAML plus ``key.path=value`` overrides (``pdm_lab.lab.yaml_config.read_yaml``:
    safe loading, YAML 1.2 numbers, no duplicate keys or aliases).

    ``plugins`` listed in the file or the overrides are imported first, so a plugin may register
    a mask rule that the ``mask:`` section then names.
    """
    raw = read_yaml(path) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides)
    import_plugins(raw.get("plugins") or ())
    return from_dict(TrainConfig, raw)


def import_plugins(modules: Any) -> None:
    """Import each plugin module (a dotted name, or a path to a .py file)."""
    import importlib
    import importlib.util
    import sys

    if isinstance(modules, str):
        modules = [modules]
    for mod in modules:
        if not isinstance(mod, str) or not mod:
            raise ConfigError(f"plugins: expected module names or .py paths, got {mod!r}")
        if str(mod).endswith(".py"):
            name = f"pdm_lab_plugin_{Path(mod).stem}"
            if name in sys.modules:
                continue
            if not Path(mod).is_file():
                raise ConfigError(f"plugins: {mod!r} is not a file")
            spec = importlib.util.spec_from_file_location(name, mod)
            if spec is None or spec.loader is None:
                raise ConfigError(f"plugins: cannot import {mod!r}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as err:
                if err.name and mod.startswith(err.name):  # the plugin itself, not one of its imports
                    raise ConfigError(f"plugins: no module named {mod!r}") from None
                raise


def config_to_dict(cfg: TrainConfig) -> dict:
    """Plain dict for YAML/JSON (``pdm_lab.config.to_dict``)."""
    return to_dict(cfg)


def save_config(cfg: TrainConfig, path: str | Path, header: str = "") -> None:
    """Write the resolved config as YAML (loads back to an equal TrainConfig)."""
    text = dump_yaml(config_to_dict(cfg))
    Path(path).write_text((header + "\n" if header else "") + text, encoding="utf-8")
