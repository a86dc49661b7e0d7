"""verl's top-K runtime patch set (tested with verl 0.9.1): μ's top-K from vLLM to the actor's loss.

verl's vLLM server forces ``logprobs=0`` and its actor loss sees one log-prob per token, so the
top-K rules (``pdm_*``, ``dppo_topk_*``, ``seq_topk_kl``) need data verl does not carry. DPPO's
own verl fork edits the server, the agent loop and the actor; this module makes the same three
edits as small patches applied at import time, each checked against the installed verl first.

One module of ~560 lines on purpose: it is one versioned patch set — every patched verl target,
its signature check and its revert are read and reviewed together against one verl release.

Turn it on with one environment variable, K, in every verl process (the ``verl.plugins`` entry
point imports ``pdm_lab.integrations.verl`` on ``import verl`` in each worker, which calls
``apply(K)`` when it is set), and pick a top-K rule as the policy loss::

    export PDM_LAB_VERL_TOPK=20              # local Ray: workers inherit the driver's environment
    python -m verl.trainer.main_ppo ... \\
      +ray_kwargs.ray_init.runtime_env.env_vars.PDM_LAB_VERL_TOPK='"20"' \\   # multi-node
      actor_rollout_ref.rollout.calculate_log_probs=true \\
      actor_rollout_ref.rollout.logprobs_mode=processed_logprobs \\
      actor_rollout_ref.actor.policy_loss._target_=pdm_lab.integrations.verl.PDMPolicyLossConfig \\
      actor_rollout_ref.actor.policy_loss.loss_mode=pdm_lab.pdm_topk \\
      '+actor_rollout_ref.actor.policy_loss.mask={k:20,delta:0.15}' \\
      algorithm.rollout_correction.bypass_mode=true algorithm.rollout_correction.rollout_is=null

(``pdm-lab promote --target verl`` writes exactly this for a top-K rule.) K > 20 also needs
``+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=K`` (vLLM's default cap is 20).

Patched targets (``TARGETS``; ``check_targets`` verifies each one's parameters and the source
lines the patch relies on, and that each replaced module global has no other user, before
anything is patched, so a verl upgrade fails at ``apply``):

1. ``vllm_async_server.SamplingParams`` (module global, used by ``vLLMHttpServer.generate``):
   a request verl builds with ``logprobs=0`` asks for ``logprobs=K`` instead. vLLM then returns
   the top-K plus the sampled token per position; verl's own per-token ``log_probs`` (read by the
   sampled id) are unchanged. ``logprobs_mode=processed_logprobs`` (verl's default) makes them μ,
   the distribution actually sampled (after temperature and top-k/top-p; cut tokens are −inf).
2. ``vllm_async_server.extract_prompt_logprobs`` (module global, called by ``generate`` with the
   final ``RequestOutput`` and the ``extra_fields`` dict the ``TokenOutput`` carries): also
   writes ``rollout_topk_ids``/``rollout_topk_logp`` [T, K] arrays (``verl_topk.topk_from_vllm``:
   entry t of the completion is the distribution that produced response token t, the
   logit-aligned position; the sampled token re-picked by id).
3. ``AgentLoopWorker._agent_loop_postprocess``: takes the two arrays out of ``extra_fields``
   (before rewards see them) and pads them to [1, response_length, K] (−1 / −inf) the way verl
   pads ``rollout_log_probs`` (``verl_topk.pad_topk``). Single-turn responses only: a response
   whose length differs from the server's token count (tool tokens) is refused.
4. ``AgentLoopWorker._postprocess``: concatenates them into the batch as ``rollout_topk_ids`` /
   ``rollout_topk_logp`` [B, T, K], beside ``rollout_log_probs``; the trainer's
   ``to_tensordict`` and micro-batch split carry them to the actor like any [B, ...] field.
5. ``FSDPEngineWithLMHead.prepare_model_outputs``: the one place where the actor holds the
   logits (the model's no-padding [nnz, V] output, before verl turns it into log-probs). When the
   micro-batch carries the top-K and a loss is computed, it keeps a reference to those logits and
   the rollout temperature for the loss of the same ``forward_step`` (no copy; released when the
   loss reads it). Chosen over patching the loss or the log-prob function because verl calls the
   loss right after it, with the same micro-batch, and nothing else in the step changes.
6. ``transformer_impl.logprobs_from_logits`` (module global): while such logits are kept, verl's
   log-prob is computed with ``inplace_backward=False``: flash-attn's in-place backward writes
   the gradient into the logits' storage, which the top-K loss's backward still reads.

Not patched: the loss dispatch. ``apply`` registers ``pdm_lab.<rule>`` for every top-K rule
through verl's public ``register_policy_loss``; verl's own ``ppo_loss`` calls it (entropy bonus,
KL loss and metric aggregation stay verl's), and it runs ``verl_topk.topk_policy_loss`` on the
kept logits: the support from the batch's top-K, π on it through the chunked gather, and the
core's ``pdm_policy_loss``, normalised with verl's global batch counts as ``agg_loss`` does.

Limits (refused with a message, not silently wrong): FSDP engine only (elsewhere the loss finds
no kept logits and says so), remove-padding on, no fused kernels, no Ulysses sequence
parallelism, one temperature per batch, single-turn agent loop, no rollout IS weights, no top-K
distillation in the same run. Tested through the trainer's ``to_tensordict`` →
``left_right_2_no_padding`` → micro-batch path on CPU; vLLM itself, a Ray cluster and the v1
trainer's transfer queue are not exercised (tests_frameworks/verl). Modules a process never imports
(the vLLM server in a trainer process, which has no vLLM) are patched when first imported.
``apply`` is idempotent; ``unapply`` (or the ``patched(k)`` context manager) restores everything.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib.abc
import importlib.util
import inspect
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from pdm_lab.integrations.versions import require_version

VERL_VERSION = require_version("verl")

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss  # noqa: E402

from pdm_lab.integrations.verl_config import LOSS_PREFIX, TOPK_ENV  # noqa: E402
from pdm_lab.integrations.verl_topk import TOPK_KEYS, pad_topk, topk_from_vllm, topk_policy_loss, topk_rules  # noqa: E402

#: Environment variable: K, μ's top-K carried from the rollout; set → ``apply(K)`` on ``import verl``.
PATCH_ENV = TOPK_ENV

SERVER = "verl.workers.rollout.vllm_rollout.vllm_async_server"
SERVER_UTILS = "verl.workers.rollout.vllm_rollout.utils"
AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"
ENGINE = "verl.workers.engine.fsdp.transformer_impl"
LOSSES = "verl.workers.utils.losses"


class PatchTargetError(RuntimeError):
    """An installed verl differs from the one the patch set was written for."""


@dataclass(frozen=True)
class Target:
    """One function of verl the patch set replaces or relies on.

    ``params`` are its parameter names in order; ``needs`` fragments of its source (compared with
    whitespace collapsed) that the patch depends on: the call it intercepts, the field it reads.
    """

    module: str
    qualname: str
    params: tuple[str, ...]
    needs: tuple[str, ...] = ()
    why: str = ""


TARGETS: tuple[Target, ...] = (
    Target(SERVER, "vLLMHttpServer.generate",
           ("self", "prompt_ids", "sampling_params", "request_id", "image_data", "video_data", "audio_data",
            "mm_processor_kwargs", "priority", "kv_transfer_params"),
           ('sampling_params["logprobs"] = 0 if sampling_params.pop("logprobs", False) else None',
            "sampling_params = SamplingParams(max_tokens=max_tokens, **sampling_params)",
            "extract_prompt_logprobs( output=final_res, num_prompt_logprobs=sampling_params.prompt_logprobs, "
            "result_dict=extra_fields, )",
            "extra_fields=extra_fields"),
           "builds SamplingParams (→ logprobs=K) and hands final_res + extra_fields to extract_prompt_logprobs"),
    Target(SERVER_UTILS, "extract_prompt_logprobs", ("output", "num_prompt_logprobs", "result_dict"),
           why="wrapped: also extracts the completion's top-K into result_dict"),
    Target(AGENT_LOOP, "AgentLoopWorker._agent_loop_postprocess", ("self", "output", "validate", "kwargs"),
           ("response_logprobs = torch.tensor(output.response_logprobs + [0.0] * pad_size).unsqueeze(0)",
            "max_length=self.rollout_config.response_length", "extra_fields=output.extra_fields"),
           "wrapped: pads the top-K like rollout_log_probs"),
    Target(AGENT_LOOP, "AgentLoopWorker._postprocess", ("self", "inputs", "input_non_tensor_batch", "validate"),
           ('optional_outputs["rollout_log_probs"] = torch.cat([input.response_logprobs for input in inputs], dim=0)',
            "input.extra_fields", "return DataProto( batch=batch,"),
           "wrapped: concatenates the padded top-K into the batch"),
    Target("verl.experimental.agent_loop.single_turn_agent_loop", "SingleTurnAgentLoop.run",
           ("self", "sampling_params", "priority", "kwargs"),
           ("extra_fields=output.extra_fields",),
           "relied on: the server's extra_fields reach AgentLoopOutput.extra_fields"),
    Target(ENGINE, "FSDPEngineWithLMHead.prepare_model_outputs",
           ("self", "output", "output_args", "micro_batch", "logits_processor_func"),
           ("logits_rmpad = output.logits.squeeze(0)", 'temperature_rmpad = output_args["temperature_rmpad"]',
            "log_probs = logprobs_from_logits( logits=logits_rmpad,"),
           "wrapped: keeps the no-padding logits for the step's loss"),
    Target(ENGINE, "FSDPEngineWithLMHead.forward_step", ("self", "micro_batch", "loss_function", "forward_only"),
           ("model_output = self.prepare_model_outputs( output=raw_output, output_args=output_args, "
            "micro_batch=micro_batch, logits_processor_func=loss_function )",
            "loss, metrics = loss_function( model_output=model_output, data=micro_batch,"),
           "relied on: the loss follows prepare_model_outputs with the same micro-batch"),
    Target(LOSSES, "ppo_loss", ("config", "model_output", "data", "dp_group"),
           ("policy_loss_fn = get_policy_loss_fn(loss_mode)", "old_log_prob=old_log_prob, log_prob=log_prob,"),
           "relied on: dispatches the registered pdm_lab.<rule> loss"),
)


# --- checking the targets -------------------------------------------------------------------

def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _node(tree: ast.Module, qualname: str) -> ast.AST | None:
    scope: Any = tree
    for part in qualname.split("."):
        scope = next((n for n in getattr(scope, "body", []) if isinstance(
            n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part), None)
        if scope is None:
            return None
    return scope


def _ast_params(fn: ast.AST) -> tuple[str, ...]:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    names += [a.vararg.arg] if a.vararg else []
    names += [p.arg for p in a.kwonlyargs]
    names += [a.kwarg.arg] if a.kwarg else []
    return tuple(names)


def _module_file(name: str) -> Path | None:
    """The installed source of verl module `name`, found without importing its packages (the
    server's package imports vLLM on import)."""
    import verl

    base = Path(verl.__file__).parent.joinpath(*name.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _live(target: Target) -> Callable | None:
    obj: Any = sys.modules[target.module]
    for part in target.qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return inspect.unwrap(obj)


def target_problem(target: Target) -> str | None:
    """Why `target` does not match (None if it does). Reads the live object when its module is
    imported, else the installed source file (importing the vLLM server needs vLLM)."""
    where = f"{target.module}.{target.qualname}"
    if target.module in sys.modules:
        fn = _live(target)
        if fn is None:
            return f"{where}: not found"
        params = tuple(inspect.signature(fn).parameters)
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            return f"{where}: source unavailable (replaced by something other than verl's function?)"
    else:
        path = _module_file(target.module)
        if path is None:
            return f"{target.module}: module not found"
        text = path.read_text(encoding="utf-8")
        node = _node(ast.parse(text), target.qualname)
        if node is None:
            return f"{where}: not found"
        params, source = _ast_params(node), ast.get_source_segment(text, node) or ""
    if params != target.params:
        return f"{where}: parameters {params}, expected {target.params}"
    body = _squash(source)
    missing = [frag for frag in target.needs if _squash(frag) not in body]
    if missing:
        return f"{where}: no longer contains {missing[0]!r}"
    return None


#: Module globals the patch set replaces, and the one function allowed to use each (replacing a
#: global changes every user in its module: there must be no other).
REPLACED_GLOBALS = {(SERVER, "SamplingParams"): "vLLMHttpServer.generate",
                    (SERVER, "extract_prompt_logprobs"): "vLLMHttpServer.generate",
                    (ENGINE, "logprobs_from_logits"): "FSDPEngineWithLMHead.prepare_model_outputs"}


def global_problem(module: str, name: str, user: str) -> str | None:
    """Why replacing global `name` of `module` could reach beyond `user` (None if it cannot):
    every load of the name outside the import must sit inside `user`."""
    path = _module_file(module)
    if path is None:
        return f"{module}: module not found"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inside = _node(tree, user)
    allowed = {id(n) for n in ast.walk(inside)} if inside is not None else set()
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
    if not loads:
        return f"{module}.{name}: no longer used"
    stray = [n.lineno for n in loads if id(n) not in allowed]
    if stray:
        return f"{module}.{name}: also used outside {user} (line {stray[0]}); replacing it would change that too"
    return None


def check_targets(targets: tuple[Target, ...] = TARGETS) -> None:
    """Raise ``PatchTargetError`` listing every target that differs from verl 0.9.1's."""
    problems = [p for p in (target_problem(t) for t in targets) if p]
    modules = {t.module for t in targets}
    problems += [p for (module, name), user in REPLACED_GLOBALS.items() if module in modules
                 for p in [global_problem(module, name, user)] if p]
    if problems:
        raise PatchTargetError(
            f"pdm_lab's verl top-K patch set was written for verl 0.9.1 (installed {VERL_VERSION}); "
            "these targets differ, so nothing was patched:\n  " + "\n  ".join(problems))


# --- the replacements -----------------------------------------------------------------------

def topk_sampling_params(original: Callable, k: int) -> Callable:
    """``SamplingParams`` for verl's server: a request with ``logprobs=0`` asks for the top-K."""
    def build(*args: Any, **kwargs: Any) -> Any:
        if type(kwargs.get("logprobs")) is int and kwargs["logprobs"] == 0:
            kwargs["logprobs"] = k
        return original(*args, **kwargs)
    build._pdm_lab_original = original
    return build


def server_topk(position_logprobs: list, token_ids: list[int], k: int) -> dict[str, Any]:
    """One completion's per-position ``{id: Logprob}`` → ``{rollout_topk_ids: [T, K] int32,
    rollout_topk_logp: [T, K] float32}`` numpy arrays (compact for Ray), at logit-aligned
    positions with the sampled token re-picked by id (``topk_from_vllm``)."""
    responses = torch.tensor([list(token_ids)], dtype=torch.long).reshape(1, -1)
    ids, logp, _ = topk_from_vllm([list(position_logprobs)], responses, k)
    return {TOPK_KEYS[0]: ids[0].to(torch.int32).numpy(), TOPK_KEYS[1]: logp[0].numpy()}


def topk_extract(original: Callable, k: int) -> Callable:
    """``extract_prompt_logprobs`` that also puts the completion's top-K into ``result_dict``."""
    @functools.wraps(original)
    def extract(output: Any, num_prompt_logprobs: Any, result_dict: dict) -> Any:
        out = original(output=output, num_prompt_logprobs=num_prompt_logprobs, result_dict=result_dict)
        completion = output.outputs[0] if output.outputs else None
        if completion is not None and completion.logprobs is not None:
            result_dict.update(server_topk(completion.logprobs, completion.token_ids, k))
        return out
    return extract


def topk_agent_loop_postprocess(original: Callable) -> Callable:
    @functools.wraps(original)
    async def _agent_loop_postprocess(self: Any, output: Any, validate: Any, **kwargs: Any) -> Any:
        ids, logp = (output.extra_fields.pop(key, None) for key in TOPK_KEYS)
        result = await original(self, output, validate, **kwargs)
        if ids is not None:
            length = self.rollout_config.response_length
            rows, n = len(ids), len(output.response_ids)
            if not (rows == n or (rows > n and n == length)):
                raise ValueError(f"{TOPK_KEYS[0]}: {rows} positions from the server for a response of {n} tokens; "
                                 "pdm_lab's verl top-K patch supports single-turn agent loops only")
            k = int(ids.shape[1]) if hasattr(ids, "shape") else len(ids[0])
            result.extra_fields[TOPK_KEYS[0]], result.extra_fields[TOPK_KEYS[1]] = pad_topk(ids, logp, length, k)
        return result
    return _agent_loop_postprocess


def topk_postprocess(original: Callable) -> Callable:
    @functools.wraps(original)
    def _postprocess(self: Any, inputs: list, *args: Any, **kwargs: Any) -> Any:
        carried = [tuple(inp.extra_fields.pop(key, None) for key in TOPK_KEYS) for inp in inputs]
        out = original(self, inputs, *args, **kwargs)
        have = [ids is not None for ids, _ in carried]
        if any(have):
            if not all(have):
                missing = have.index(False)
                raise ValueError(f"{TOPK_KEYS[0]}: response {missing} of the batch carries no top-K while others do")
            for slot, key in enumerate(TOPK_KEYS):
                out.batch[key] = torch.cat([c[slot] for c in carried], dim=0)
        return out
    return _postprocess


class _Kept(threading.local):
    """The logits of the current ``forward_step``, kept for its loss (per thread)."""

    value: tuple[torch.Tensor, float, Any] | None = None


KEPT = _Kept()


def _kept_logits(engine: Any, output: Any, output_args: dict, micro_batch: Any) -> tuple[torch.Tensor, float, Any]:
    from verl.utils import tensordict_utils as tu

    def refuse(why: str) -> None:
        raise ValueError(f"pdm_lab's verl top-K patch: {why} is not supported (the top-K loss needs the "
                         "full no-padding logits of this rank's micro-batch)")
    if not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
        refuse("use_remove_padding=False")
    if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
        refuse("use_fused_kernels=True")
    if getattr(engine, "use_ulysses_sp", False) or output_args.get("pad_size", 0):
        refuse("Ulysses sequence parallelism or a padded packed length")
    if tu.get_non_tensor_data(data=micro_batch, key="distillation_use_topk", default=False):
        refuse("top-K distillation in the same run")
    logits = output.logits.squeeze(0)
    if hasattr(logits, "full_tensor"):  # tensor parallel: vocab-sharded DTensor
        logits = logits.full_tensor()
    temperature = output_args["temperature_rmpad"]
    if not bool((temperature == temperature[0]).all()):
        refuse("a per-sample temperature")
    return logits, float(temperature[0]), micro_batch


def topk_prepare_model_outputs(original: Callable) -> Callable:
    @functools.wraps(original)
    def prepare_model_outputs(self: Any, output: Any, output_args: dict, micro_batch: Any,
                              logits_processor_func: Any) -> Any:
        KEPT.value = None
        if logits_processor_func is not None and TOPK_KEYS[0] in micro_batch.keys():
            KEPT.value = _kept_logits(self, output, output_args, micro_batch)
        return original(self, output, output_args, micro_batch, logits_processor_func)
    return prepare_model_outputs


def topk_logprobs_from_logits(original: Callable) -> Callable:
    @functools.wraps(original)
    def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
        if KEPT.value is not None and KEPT.value[0] is logits:
            inplace_backward = False  # the top-K loss's backward reads these logits
        return original(logits, labels, inplace_backward=inplace_backward)
    return logprobs_from_logits


def topk_verl_loss(rule: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                   response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                   rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``PolicyLossFn`` for a top-K `rule`: ``topk_policy_loss`` on the logits kept by
    the patched ``prepare_model_outputs`` of the same step (verl's log-probs are not used)."""
    if rollout_is_weights is not None:
        raise ValueError(f"{LOSS_PREFIX}{rule}: rollout_is_weights given; pdm_lab's rules replace IS "
                         "weighting (set algorithm.rollout_correction.rollout_is=null)")
    kept, KEPT.value = KEPT.value, None
    if kept is None:
        raise RuntimeError(f"{LOSS_PREFIX}{rule} reads μ's top-K, and this step carried none: set {PATCH_ENV}=K in "
                           "every verl process (pdm_lab.integrations.verl_patches) so the rollout returns it and "
                           "the actor keeps the logits")
    logits, temperature, data = kept
    if tuple(data["responses"].shape) != tuple(log_prob.shape):
        raise RuntimeError(f"{LOSS_PREFIX}{rule}: kept logits belong to a micro-batch of responses "
                           f"{tuple(data['responses'].shape)}, the loss got {tuple(log_prob.shape)}")
    from pdm_lab.integrations.verl_rollout_correction import verl_rollout_correction

    # the top-K loss takes its response mask from the kept batch: verl's rejection mask is refused
    _, corr_metrics = verl_rollout_correction(rule, config, old_log_prob, log_prob, response_mask,
                                              rejection=False)
    loss, metrics = topk_policy_loss(config, logits, data, rule=rule, temperature=temperature,
                                     loss_agg_mode=loss_agg_mode)
    return loss, {**metrics, **corr_metrics}


# --- applying -------------------------------------------------------------------------------

@dataclass
class _State:
    k: int
    originals: list[tuple[Any, str, Any]]
    pending: dict[str, Callable[[], None]]
    losses: tuple[str, ...]


_STATE: _State | None = None


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches a module right after its first import (the server's module imports vLLM, which
    only rollout processes have)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if _STATE is None or name not in _STATE.pending:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            if _STATE is not None and name in _STATE.pending:
                _STATE.pending.pop(name)()
        spec.loader.exec_module = exec_then_patch
        return spec


_FINDER = _AfterImport()


def _replace(owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
    original = getattr(owner, attr)
    _STATE.originals.append((owner, attr, original))
    setattr(owner, attr, make(original))


def _patch_module(name: str) -> None:
    """Apply the patches of module `name` (imported now); re-checks its targets first."""
    check_targets(tuple(t for t in TARGETS if t.module == name))
    module, k = sys.modules[name], _STATE.k
    if name == SERVER:
        _replace(module, "SamplingParams", lambda original: topk_sampling_params(original, k))
        _replace(module, "extract_prompt_logprobs", lambda original: topk_extract(original, k))
    elif name == AGENT_LOOP:
        _replace(module.AgentLoopWorker, "_agent_loop_postprocess", topk_agent_loop_postprocess)
        _replace(module.AgentLoopWorker, "_postprocess", topk_postprocess)
    elif name == ENGINE:
        _replace(module.FSDPEngineWithLMHead, "prepare_model_outputs", topk_prepare_model_outputs)
        _replace(module, "logprobs_from_logits", topk_logprobs_from_logits)


def apply(k: int) -> bool:
    """Apply the patch set for μ's top-K of size `k`. Idempotent (False if already applied with
    this K; a different K is an error). Checks every target first: on a mismatch nothing is
    patched and ``PatchTargetError`` lists them."""
    global _STATE
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{PATCH_ENV}: K must be a positive integer, got {k!r}")
    if _STATE is not None:
        if _STATE.k != k:
            raise ValueError(f"pdm_lab's verl top-K patch set is applied with K={_STATE.k}; asked for K={k}")
        return False
    check_targets()
    losses = []
    for rule in topk_rules():
        name = f"{LOSS_PREFIX}{rule}"
        if name not in POLICY_LOSS_REGISTRY:
            register_policy_loss(name)(functools.partial(topk_verl_loss, rule))
            losses.append(name)
    _STATE = _State(k=k, originals=[], pending={}, losses=tuple(losses))
    for name in (SERVER, AGENT_LOOP, ENGINE):
        if name in sys.modules:
            _patch_module(name)
        else:
            _STATE.pending[name] = functools.partial(_patch_module, name)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return True


def unapply() -> bool:
    """Undo ``apply``: restore every replaced attribute, drop pending patches and the losses it
    registered. Returns False if nothing was applied."""
    global _STATE
    if _STATE is None:
        return False
    for owner, attr, original in reversed(_STATE.originals):
        setattr(owner, attr, original)
    for name in _STATE.losses:
        POLICY_LOSS_REGISTRY.pop(name, None)
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    KEPT.value = None
    _STATE = None
    return True


def applied_k() -> int | None:
    """K of the applied patch set, or None."""
    return None if _STATE is None else _STATE.k


@contextlib.contextmanager
def patched(k: int) -> Iterator[None]:
    """``apply(k)`` for the block, then ``unapply`` (tests)."""
    apply(k)
    try:
        yield
    finally:
        unapply()


def apply_from_env() -> int | None:
    """``apply(K)`` when ``PDM_LAB_VERL_TOPK`` is set (the plugin calls this); returns K."""
    import os

    raw = os.environ.get(PATCH_ENV, "").strip()
    if not raw:
        return None
    try:
        k = int(raw)
    except ValueError:
        raise ValueError(f"{PATCH_ENV}={raw!r}: K must be a positive integer") from None
    apply(k)
    return k


__all__ = ["PATCH_ENV", "TARGETS", "Target", "PatchTargetError", "apply", "unapply", "patched", "applied_k",
           "apply_from_env", "check_targets", "target_problem", "topk_sampling_params", "server_topk",
           "topk_extract", "topk_verl_loss", "KEPT"]
