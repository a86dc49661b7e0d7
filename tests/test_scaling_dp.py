"""Data-parallel aggregation in the scaling loop: one ``update_policy`` on 2 FSDP2 ranks (gloo), each
holding half of a batch, moves the parameters as one rank does on the whole batch, for token-mean and
a sequence mean. The ranks hold different token counts, so a rank normalising by its own count
(the planted bug: ``DPInfo.all_reduce`` answering the rank's own counts) moves them elsewhere."""
from __future__ import annotations


import pytest
import torch

from pdm_lab.aggregation import DPInfo
from pdm_lab.mask_config import MaskConfig
from pdm_lab.scaling import train_step
from pdm_lab.scaling.config import TinyModelConfig, TrainerConfig
from pdm_lab.scaling.policy_model import PolicyModel
from pdm_lab.scaling.tiny_model import build_model

from test_scaling_units import VOCAB, StepCfg, fake_batch

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, -0.3, 0.3])


def _setup(aggregation: str):
    torch.manual_seed(0)
    lm = build_model(TinyModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=16,
                                     max_position_embeddings=64, init_std=0.5), VOCAB, eos_id=1, pad_id=0)
    batch = fake_batch(lm, n_prompts=2, g=4, seed=4, temperature=0.6)  # μ ≠ π: the mask drops tokens
    cfg = StepCfg(mask=MaskConfig(rule="pdm_topk", k=5, delta=0.02, aggregation=aggregation),
                  trainer=TrainerConfig(mini_batches=1, micro_batch_size=2, param_dtype="fp32", grad_clip=None))
    return lm, batch, cfg


def _step(policy, batch, adv, cfg):
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    return train_step.update_policy(policy, opt, batch, adv, cfg=cfg, vocab_size=VOCAB, pad_id=0, lr=0.5)


def _worker(rank: int, world: int, store: str, aggregation: str, planted: bool, queue) -> None:
    import torch.distributed as dist

    from pdm_lab.scaling.policy_model import shard_policy

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        lm, batch, cfg = _setup(aggregation)
        half = list(range(rank * 4, rank * 4 + 4))
        if planted:
            class LocalCounts(DPInfo):
                @classmethod
                def all_reduce(cls, tokens, sequences, **kwargs):
                    return DPInfo(tokens=tokens, sequences=sequences, world=world)
            train_step.DPInfo = LocalCounts
        policy = shard_policy(lm, param_dtype="fp32", reduce_dtype="fp32", gradient_checkpointing=False)
        metrics = _step(policy, batch.select(half), ADV[half], cfg).metrics
        # numpy arrays travel by value (a tensor through the queue is shared memory of this process)
        full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()
                for name, p in policy.named_parameters()}
        queue.put((rank, full, metrics["loss/policy"]))
    finally:
        dist.destroy_process_group()


def _two_ranks(tmp_path, aggregation: str, planted: bool):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = str(tmp_path / f"store-{aggregation}-{planted}")
    procs = [ctx.Process(target=_worker, args=(r, 2, store, aggregation, planted, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=300) for _ in procs), key=lambda x: x[0])
    for p in procs:
        p.join(timeout=60)
    return [(rank, {n: torch.from_numpy(a) for n, a in params.items()}, loss) for rank, params, loss in results]


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token-mean", pytest.param("seq-mean-token-sum", marks=pytest.mark.extended)])
def test_two_fsdp2_ranks_step_as_one_rank_on_the_whole_batch(tmp_path, aggregation):
    lm, batch, cfg = _setup(aggregation)
    assert batch.select(range(4)).response_mask.sum() != batch.select(range(4, 8)).response_mask.sum()
    policy = PolicyModel(lm)
    start = {name: p.detach().clone() for name, p in policy.named_parameters()}
    single = _step(policy, batch, ADV, cfg).metrics
    want = {name: p.detach().clone() for name, p in policy.named_parameters()}
    assert single["mask/frac_dropped"] > 0
    (_, got, loss0), (_, got1, loss1) = _two_ranks(tmp_path, aggregation, planted=False)
    assert loss0 == loss1 == pytest.approx(single["loss/policy"], rel=1e-5)  # the whole batch's, on each
    step = max(float((w - start[n]).abs().max()) for n, w in want.items())
    assert step > 1e-3, step
    for name, w in want.items():
        # float32 sums in another order (per rank, then FSDP's reduce): 0.1% of the step
        torch.testing.assert_close(got[name], w, rtol=0, atol=1e-3 * step)
        torch.testing.assert_close(got1[name], w, rtol=0, atol=1e-3 * step)
    (_, bad, _), _ = _two_ranks(tmp_path, aggregation, planted=True)
    gap = max(float((bad[n] - w).abs().max()) for n, w in want.items())
    assert gap > 0.02 * step, (gap, step)  # the locally normalised ranks step elsewhere
