"""The sampling mask over several TRL steps with unchanged weights (learning rate 0), HF generate at
top_p 0.9 on the tiny Qwen3: D of every step's first loss call stays at step 1's level (fp32 rounding,
≤ 1e-6), with prompts of different lengths in one micro-batch (left padding that changes per step)."""
from __future__ import annotations

import pytest
import torch

from pdm_lab import MaskConfig

from test_trl_trainer import build_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny-qwen3-steps"))


def _reward(completions, **kwargs):
    return [float(sum(map(ord, c[0]["content"])) % 7) for c in completions]


def test_top_p_sampling_mask_d_stays_at_rounding_over_steps_with_unchanged_weights(tiny_dir, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig

    from pdm_lab.integrations.trl import PDMGRPOTrainer

    seen = []

    class Recording(PDMGRPOTrainer):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            m = self.pdm_last_output.metrics
            seen.append((self.state.global_step, float(m["div/topk_kl_mean"]), float(m["div/topk_kl_max"]),
                         tuple(inputs["prompt_mask"].sum(1).tolist())))
            return loss

    # prompts of 5 lengths, two per micro-batch: each step's left padding differs
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i} + {i + 1} =" + " 7" * (i % 5)}]}
                              for i in range(16)])
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=10, max_steps=3, learning_rate=0.0, beta=0.0, temperature=1.0,
                      top_k=0, top_p=0.9, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                      bf16=False)
    trainer = Recording(model=str(tiny_dir), reward_funcs=_reward, args=args, train_dataset=data,
                        mask=MaskConfig(rule="pdm_topk", k=8))
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert trainer.pdm_sampling is not None and trainer.pdm_sampling.top_p == 0.9
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # lr 0: unchanged
    assert [s[0] for s in seen] == [0, 1, 2], seen
    assert any(len(set(s[3])) > 1 for s in seen), seen  # left padding inside a micro-batch
    for step, mean_d, max_d, _ in seen:
        assert mean_d <= 1e-6 and max_d <= 1e-5, seen  # step 1's level at every step, not 5e-4
