"""Scaling configs: every shipped config loads, unknown keys and bad values are clear errors, the
paper configs pass --dry-run against a fake local model + tiny JSONL, and the CLI reports errors
as a user sees them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdm_lab.config import ConfigError
from pdm_lab.mask_config import MaskConfig
from pdm_lab.scaling.config import TrainConfig, load_config, save_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "scaling" / "configs").glob("*.yaml"))
PAPER = [p for p in CONFIGS if p.name.startswith("qwen3-")]
Q4B = REPO / "scaling" / "configs" / "qwen3-4b-base-dapo.yaml"


def test_readme_and_shipped_configs_agree():
    """Every config the README names is shipped, and every shipped config is in the README."""
    import re

    named = set(re.findall(r"[\w.-]+\.yaml", (REPO / "README.md").read_text(encoding="utf-8")))
    shipped = {p.name for p in CONFIGS}
    assert named == shipped, (named ^ shipped)
    assert {p.name for p in PAPER} == {n for n in shipped if not n.startswith("tiny-")}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    assert type(cfg.mask) is MaskConfig  # the same type the toy sweeps use
    out = tmp_path / "again.yaml"
    save_config(cfg, out)
    assert load_config(out) == cfg


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_configs_follow_spec_section_7(path):
    cfg = load_config(path)
    assert cfg.mask.k == 20 and cfg.mask.delta == 0.15
    assert cfg.rollout.group_size == 16 and cfg.rollout.prompts_per_step == 256
    assert cfg.trainer.mini_batches == 8 and cfg.trainer.lr == 1e-6
    assert cfg.mask.aggregation == "seq-mean-token-sum-norm"
    assert cfg.reward.verifier == "math" and cfg.eval.k == 16
    assert cfg.trainer.param_dtype == "bf16"
    if "fp8" in path.name:
        assert cfg.rollout.precision == "fp8"


def test_unknown_key_names_the_nearest(tmp_path):
    raw = yaml.safe_load((REPO / "scaling/configs/tiny-cpu.yaml").read_text())
    raw["rollout"]["temprature"] = 0.7
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="temprature.*did you mean 'temperature'"):
        load_config(bad)


def test_unknown_key_in_override_and_bad_values():
    tiny = REPO / "scaling/configs/tiny-cpu.yaml"
    with pytest.raises(ConfigError, match="'rulez'"):
        load_config(tiny, ["mask.rulez=pdm_topk"])
    with pytest.raises(ConfigError, match="mask.rule"):
        load_config(tiny, ["mask.rule=not_a_rule"])
    with pytest.raises(ConfigError, match="rollout.precision"):
        load_config(tiny, ["rollout.precision=fp4"])
    with pytest.raises(ConfigError, match="exactly one of model.path"):
        load_config(tiny, ["model.path=somewhere"])
    cfg = load_config(tiny, ["mask.rule=dppo_topk_kl", "total_steps=3", "rollout.temperature=0.7"])
    assert (cfg.mask.rule, cfg.total_steps, cfg.rollout.temperature) == ("dppo_topk_kl", 3, 0.7)


def test_missing_required_section(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("data: {synthetic: {}}\n")
    with pytest.raises(ConfigError, match="model"):
        load_config(p)


# ---------------------------------------------------------------------------- dry run

def make_fake_model(root: Path) -> Path:
    """A tiny local Qwen3 directory (random weights, locally trained tokenizer, chat template)."""
    from pdm_lab.scaling.config import TinyModelConfig
    from pdm_lab.scaling.tiny_model import build_model, build_tokenizer

    tok = build_tokenizer(["what is 1 + 2? answer 3", "\\boxed{42} Answer: 7"] * 50, 300)
    tiny = TinyModelConfig(vocab_size=300, max_position_embeddings=32768)
    model = build_model(tiny, 300, tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
    root.mkdir(parents=True)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def fake_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    model = make_fake_model(root / "model")
    train = write_jsonl(root / "dapo.jsonl", [
        {"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
         "reward_model": {"ground_truth": str(2 * i)}} for i in range(300)])
    aime = write_jsonl(root / "aime24.jsonl", [{"problem": f"Find {i}.", "answer": i} for i in range(5)])
    return {"model": model, "train": train, "aime": aime, "root": root}


def paper_overrides(assets) -> list[str]:
    return [f"model.path={assets['model']}", f"data.train_files=[{assets['train']}]",
            f"data.eval_files=[{assets['aime']}]"]


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_configs_dry_run(path, fake_assets):
    from pdm_lab.scaling.dryrun import dry_run

    report = dry_run(load_config(path, paper_overrides(fake_assets)), log=lambda *_: None)
    assert report["data"]["train_prompts"] == 300
    assert report["data"]["eval_sets"] == {"aime24": 5}
    assert report["model"]["architecture"] == "Qwen3ForCausalLM"
    assert report["sequences_per_rank"] == 256 // (8 // path_tp(path)) * 16 // path_tp(path)


def path_tp(path: Path) -> int:
    return load_config(path).rollout.tensor_parallel_size


def test_dry_run_missing_model_path(tmp_path, fake_assets):
    from pdm_lab.scaling.assets import ModelPathError
    from pdm_lab.scaling.dryrun import dry_run

    cfg = load_config(Q4B, paper_overrides(fake_assets) + [f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(ModelPathError, match="is not a directory"):
        dry_run(cfg)


def test_dry_run_broken_prompt_row(tmp_path, fake_assets):
    from pdm_lab.scaling.data import DataError
    from pdm_lab.scaling.dryrun import dry_run

    rows = [json.dumps({"prompt": "q", "reward_model": {"ground_truth": "1"}})] * 300
    rows[7] = '{"prompt": "broken json'
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = load_config(Q4B, paper_overrides(fake_assets) + [f"data.train_files=[{bad}]"])
    with pytest.raises(DataError, match=r"bad\.jsonl:8: bad prompt row: invalid JSON"):
        dry_run(cfg)
    ok = dry_run(load_config(Q4B, paper_overrides(fake_assets)
                             + [f"data.train_files=[{bad}]", "data.on_bad_row=skip"]), log=lambda *_: None)
    assert ok["data"]["train_prompts"] == 299


def test_dry_run_too_few_prompts(tmp_path, fake_assets):
    from pdm_lab.scaling.dryrun import DryRunError, dry_run

    few = write_jsonl(tmp_path / "few.jsonl", [{"prompt": "q", "reward_model": {"ground_truth": "1"}}] * 3)
    cfg = load_config(Q4B, paper_overrides(fake_assets) + [f"data.train_files=[{few}]"])
    with pytest.raises(DryRunError, match="fewer than rollout.prompts_per_step"):
        dry_run(cfg)


def test_dry_run_layout_must_divide(fake_assets):
    from pdm_lab.scaling.dryrun import DryRunError, dry_run

    cfg = load_config(Q4B, paper_overrides(fake_assets) + ["launch.nproc_per_node=3"])
    with pytest.raises(DryRunError, match="divisible"):
        dry_run(cfg)


def test_cli_dry_run_as_a_user_runs_it(fake_assets, capsys, tmp_path, monkeypatch):
    from pdm_lab.cli.main import main

    monkeypatch.chdir(tmp_path)  # the real run below takes its run directory (relative) before it fails

    assert main(["train", "--config", str(Q4B), "--dry-run", *paper_overrides(fake_assets)]) == 0
    assert "ok" in capsys.readouterr().out
    code = main(["train", "--config", str(Q4B), "--dry-run", "model.path=/nonexistent/x"])
    assert code == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["train", "--config", str(Q4B), "rollout.bogus=1"]) == 2
    assert "unknown config key" in capsys.readouterr().err
    # a real (not dry) run with a missing model directory stops before any rank starts
    assert main(["train", "--config", str(Q4B), "model.path=/nonexistent/x"]) == 2
    assert "model.path: /nonexistent/x is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no empty run dir left


def test_tiny_config_dry_run_without_building():
    from pdm_lab.scaling.dryrun import dry_run

    report = dry_run(load_config(REPO / "scaling/configs/tiny-cpu.yaml"))
    assert report["model"]["note"] == "built on first use"


TINY = REPO / "scaling" / "configs" / "tiny-cpu.yaml"


def test_scientific_notation_in_files_and_overrides(tmp_path):
    """``1e-5`` is a number wherever a user writes it (the README's form)."""
    cfg = load_config(TINY, ["mask.delta=1e-5", "trainer.lr=1E-4", "rollout.prompts_per_step=3.2e1"])
    assert (cfg.mask.delta, cfg.trainer.lr, cfg.rollout.prompts_per_step) == (1e-5, 1e-4, 32)
    path = tmp_path / "sci.yaml"
    path.write_text(TINY.read_text().replace("lr: 0.0003", "lr: 3e-4"))
    assert load_config(path).trainer.lr == 3e-4


def test_duplicate_keys_and_aliases_refused_at_load(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text(TINY.read_text() + "\nseed: 5\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml: line \d+: duplicate key 'seed'"):
        load_config(dup)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(TINY.read_text() + "\nprovenance:\n  metrics:\n    a: &a [x, x]\n    b: [*a, *a]\n")
    with pytest.raises(ConfigError, match=r"bomb\.yaml: line \d+: alias \*a"):
        load_config(bomb)


def test_save_config_writes_no_alias_and_keeps_number_like_strings(tmp_path):
    from dataclasses import replace

    from pdm_lab.scaling.config import Provenance

    shared = {"x": [1, 2]}
    cfg = replace(load_config(TINY), name="1e-5", provenance=Provenance(metrics={"a": shared, "b": shared},
                                                                         created="2026-12-02"))
    out = tmp_path / "saved.yaml"
    save_config(cfg, out)
    text = out.read_text()
    assert "&" not in text and "*" not in text
    assert load_config(out) == cfg and load_config(out).name == "1e-5"


@pytest.mark.parametrize("override, names", [
    ("model.tiny.num_attention_heads=3", "num_attention_heads"),
    ("model.tiny.max_position_embeddings=4", "max_position_embeddings"),
    ("rollout.max_tokens=1000", "rollout.max_tokens"),
    ("rollout.max_model_len=1000", "max_model_len"),
])
def test_tiny_model_shape_checks(override, names):
    with pytest.raises(ConfigError, match=names):
        load_config(TINY, [override])


@pytest.mark.parametrize("override, names", [
    ("rollout.kv_cache_gib=1e12", "rollout.kv_cache_gib"),
    ("rollout.prompts_per_step=1e8", "rollout.prompts_per_step"),
    ("data.synthetic.n_train=10", "rollout.prompts_per_step"),
    ("checkpoint.resume=/nonexistent/ckpt", "checkpoint.resume: /nonexistent/ckpt does not exist"),
])
def test_tiny_dry_run_checks(override, names):
    from pdm_lab.scaling.dryrun import DryRunError, dry_run

    with pytest.raises(DryRunError, match=names):
        dry_run(load_config(TINY, [override]), log=lambda *_: None)


def test_dry_run_resume_path_that_exists_and_nproc(tmp_path):
    from pdm_lab.scaling.dryrun import DryRunError, dry_run

    assert dry_run(load_config(TINY, [f"checkpoint.resume={tmp_path}"]), log=lambda *_: None)["config"] == "ok"
    cfg = load_config(TINY, ["rollout.tensor_parallel_size=2"])
    with pytest.raises(DryRunError, match="launch.nproc_per_node=3"):
        dry_run(cfg, nproc=3, log=lambda *_: None)


def test_paper_model_heads_checked(fake_assets, tmp_path):
    from pdm_lab.scaling.dryrun import DryRunError, dry_run

    model_dir = Path(fake_assets["model"])
    bad = tmp_path / "model"
    bad.mkdir()
    for item in model_dir.iterdir():
        if item.is_file():
            (bad / item.name).write_bytes(item.read_bytes())
    info = json.loads((bad / "config.json").read_text())
    info.update(num_attention_heads=3, num_key_value_heads=2)
    (bad / "config.json").write_text(json.dumps(info))
    cfg = load_config(Q4B, paper_overrides(fake_assets) + [f"model.path={bad}"])
    with pytest.raises(DryRunError, match="num_attention_heads \\(3\\) is not a multiple"):
        dry_run(cfg, log=lambda *_: None)


def test_plugin_errors_name_the_plugin(tmp_path):
    with pytest.raises(ConfigError, match="plugins: no module named 'no_such_plugin_xyz'"):
        load_config(TINY, ["plugins=[no_such_plugin_xyz]"])
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(TINY, [f"plugins=[{tmp_path}/missing.py]"])
