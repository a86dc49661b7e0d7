"""Every bad input to the command line is one line naming the input and exit status 2, never a
traceback, a hang or a success; a valid value (``mask.delta=1e-5``) works. Table-driven, end to
end: each case is the real ``pdm-lab`` entry point (``pdm_lab.cli.main.main``) in its own
forked process, so its exit status is real and a hang is killed at ``CASE_TIMEOUT_S``; the runner
imports the commands once before forking, so a case costs only its own checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdm_lab.lab.locking import DirLock

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "scaling" / "configs" / "tiny-cpu.yaml"
Q4B = REPO / "scaling" / "configs" / "qwen3-4b-base-dapo.yaml"
#: A case that has not finished after this long is a hang (cases check input; none computes much).
CASE_TIMEOUT_S = 30  # a hang is any case past this; a loaded 2-core CI box needs room

E, OK = "error", "ok"
_DRY = ["train", "--config", "{tiny}", "--dry-run"]
_BENCH = ["bench", "--only", "core", "--eager-only", "--tokens", "2000", "--gather-tokens", "8", "--vocab", "1000"]
_DEMO = ["demo", "--tokens", "64", "--vocab", "100", "--out", "{tmp}/d.json"]

#: (case id, argv after ``pdm-lab``, E or OK, text the one error line must contain). ``{tmp}``: the
#: case's working directory, holding the files written by ``_files``.
TABLE = [
    # YAML files: malformed, unsafe tags, duplicate keys, aliases, nesting
    ("yaml-malformed", ["train", "--config", "{tmp}/bad.yaml"], E, "bad.yaml"),
    ("yaml-python-tag", ["train", "--config", "{tmp}/evil.yaml"], E, "python/object"),
    ("yaml-duplicate-key", ["train", "--config", "{tmp}/dup.yaml", "--dry-run"], E, "duplicate key 'seed'"),
    ("yaml-alias-bomb", ["train", "--config", "{tmp}/bomb.yaml", "--dry-run"], E, "aliases are not allowed"),
    ("yaml-deep-nesting", ["train", "--config", "{tmp}/deep.yaml", "--dry-run"], E, "nested deeper"),
    ("yaml-scientific-works", ["train", "--config", "{tmp}/sci.yaml", "--dry-run"], OK, ""),
    ("config-missing", ["train", "--config", "{tmp}/nope.yaml"], E, "nope.yaml"),
    ("plugin-missing", ["train", "--config", "{tiny}", "plugins=[no_such_plugin_xyz]"], E, "no_such_plugin_xyz"),
    # train: overrides and the dry run
    ("delta-1e-5-works", [*_DRY, "mask.delta=1e-5"], OK, ""),
    ("kernel-rule-works", [*_DRY, "mask.rule=pdm_kernel", "mask.kernel_ratio=3.0"], OK, ""),
    ("kernel-rule-sampling-cut", [*_DRY, "mask.rule=pdm_kernel", "rollout.top_p=0.9"], E, "rollout.keep_sampling_mask"),
    ("kernel-ratio-negative", [*_DRY, "mask.kernel_ratio=-1"], E, "mask.kernel_ratio"),
    ("lr-1E-4-works", [*_DRY, "trainer.lr=1E-4"], OK, ""),
    ("delta-negative-scientific", [*_DRY, "mask.delta=-2.5e+3"], E, "mask.delta"),
    ("delta-nan", ["train", "--config", "{tiny}", "mask.delta=.nan"], E, "mask.delta"),
    ("delta-empty", [*_DRY, "mask.delta="], E, "mask.delta"),
    ("delta-neg-nan", ["train", "--config", "{tiny}", "mask.delta_neg=.nan"], E, "mask.delta_neg"),
    ("lr-nan", ["train", "--config", "{tiny}", "trainer.lr=.nan"], E, "trainer.lr"),
    ("temperature-inf", ["train", "--config", "{tiny}", "rollout.temperature=.inf"], E, "rollout.temperature"),
    ("icepop-high-nan", ["train", "--config", "{tiny}", "mask.icepop_high=.nan"], E, "mask.icepop_high"),
    ("clip-ratio-c-nan", ["train", "--config", "{tiny}", "mask.clip_ratio_c=.nan"], E, "mask.clip_ratio_c"),
    ("dual-clip-nan", [*_DRY, "mask.dual_clip_c=.nan"], E, "mask.dual_clip_c"),
    ("opsm-delta-inf", [*_DRY, "mask.opsm_delta=.inf"], E, "mask.opsm_delta"),
    ("veto-floor-negative", [*_DRY, "mask.veto_floor=-1"], E, "mask.veto_floor"),
    ("band-low-nan", [*_DRY, "mask.band_low=.nan"], E, "mask.band_low"),
    ("k-fractional", ["train", "--config", "{tiny}", "mask.k=2.5"], E, "mask.k"),
    ("k-above-vocab", ["train", "--config", "{tiny}", "mask.k=100000"], E, "mask.k"),
    ("top-p-0", [*_DRY, "rollout.top_p=0"], E, "rollout.top_p"),
    ("grad-clip-0", [*_DRY, "trainer.grad_clip=0"], E, "trainer.grad_clip"),
    ("eval-k-0", [*_DRY, "eval.k=0"], E, "eval.k"),
    ("seed-beyond-int64", [*_DRY, "seed=100000000000000000000"], E, "seed"),
    ("total-steps-1e20", [*_DRY, "total_steps=1e20"], E, "total_steps"),
    ("override-empty-key", [*_DRY, "=3"], E, "'=3'"),
    ("override-into-value", [*_DRY, "mask.delta.x=3"], E, "mask.delta"),
    ("section-given-a-number", [*_DRY, "mask=3"], E, "mask"),
    ("max-prompt-tokens-0", ["train", "--config", "{tiny}", "data.max_prompt_tokens=0"], E, "data.max_prompt_tokens"),
    ("heads-3-over-2-kv", [*_DRY, "model.tiny.num_attention_heads=3"], E, "num_attention_heads"),
    ("max-position-4", [*_DRY, "model.tiny.max_position_embeddings=4"], E, "max_position_embeddings"),
    ("max-tokens-beyond-context", [*_DRY, "rollout.max_tokens=1000"], E, "max_tokens"),
    ("kv-cache-1e12", [*_DRY, "rollout.kv_cache_gib=1e12"], E, "rollout.kv_cache_gib"),
    ("prompts-per-step-1e8", [*_DRY, "rollout.prompts_per_step=1e8"], E, "rollout.prompts_per_step"),
    ("n-train-below-prompts", [*_DRY, "data.synthetic.n_train=10"], E, "rollout.prompts_per_step"),
    ("resume-missing", [*_DRY, "checkpoint.resume=/nonexistent"], E, "checkpoint.resume"),
    ("nproc-negative", [*_DRY, "--nproc", "-1"], E, "--nproc"),
    ("run-dir-locked", ["train", "--config", "{tiny}", "run_dir={tmp}/locked"], E, "in use by pid"),
    ("empty-dataset", ["train", "--config", "{q4b}", "model.path={model}", "data.train_files=[{tmp}/empty.jsonl]",
                       "data.eval_files=[]", "run_dir={tmp}/run"], E, "empty.jsonl"),
    # sweep
    ("sweep-rules-empty", ["sweep", "rules=[]", "--out", "{tmp}/s"], E, "rules"),
    ("sweep-kernel-rule-tabular", ["sweep", "rules=[pdm_topk,pdm_kernel]", "base.policy=tabular", "--out",
                                   "{tmp}/s"], E, "pdm_kernel"),
    ("sweep-deltas-empty", ["sweep", "deltas=[]", "--out", "{tmp}/s"], E, "deltas"),
    ("sweep-ks-empty", ["sweep", "ks=[]", "--out", "{tmp}/s"], E, "ks"),
    ("sweep-mismatches-empty", ["sweep", "mismatches=[]", "--out", "{tmp}/s"], E, "mismatches"),
    ("sweep-conventions-empty", ["sweep", "conventions=[]", "--out", "{tmp}/s"], E, "conventions"),
    ("sweep-ks-above-vocab", ["sweep", "ks=[1000000]", "--out", "{tmp}/s"], E, "ks"),
    ("sweep-lr-scientific-parses", ["sweep", "base.lr=1e-3", "rules=[]", "--out", "{tmp}/s"], E, "rules"),
    ("sweep-yaml-scientific-parses", ["sweep", "--config", "{tmp}/sci-sweep.yaml", "--out", "{tmp}/s"], E, "rules"),
    ("sweep-yaml-duplicate-key", ["sweep", "--config", "{tmp}/dup-sweep.yaml", "--out", "{tmp}/s"], E, "'rules'"),
    ("sweep-seeds-beyond-int64", ["sweep", "seeds=100000000000000000000", "--out", "{tmp}/s"], E, "seeds"),
    ("sweep-seeds-1e20", ["sweep", "seeds=1e20", "--out", "{tmp}/s"], E, "seeds"),
    ("sweep-modulus-0", ["sweep", "base.problem.token_mdp.modulus=0", "--out", "{tmp}/s"], E, "modulus"),
    ("sweep-grammar-states-0", ["sweep", "base.problem.token_mdp.task=grammar",
                                "base.problem.token_mdp.grammar_states=0", "--out", "{tmp}/s"], E, "grammar_states"),
    ("sweep-task-unknown", ["sweep", "base.problem.token_mdp.task=foo", "--out", "{tmp}/s"], E, "task"),
    ("sweep-eos-fraction-2", ["sweep", "base.problem.token_mdp.eos_top_fraction=2", "--out", "{tmp}/s"], E,
     "eos_top_fraction"),
    ("sweep-spread-below-1", ["sweep", "base.problem.token_mdp.temperature_spread=0.5", "--out", "{tmp}/s"], E,
     "temperature_spread"),
    ("sweep-first-seed-negative", ["sweep", "first_seed=-1", "--out", "{tmp}/s"], E, "first_seed"),
    ("sweep-optimizer-unknown", ["sweep", "base.optimizer=foo", "--out", "{tmp}/s"], E, "optimizer"),
    ("sweep-collapse-drop-2", ["sweep", "base.collapse_drop=2", "--out", "{tmp}/s"], E, "collapse_drop"),
    ("sweep-deltas-neg", ["sweep", "deltas=[-1]", "--out", "{tmp}/s"], E, "deltas"),
    ("sweep-ks-0", ["sweep", "ks=[0]", "--out", "{tmp}/s"], E, "ks"),
    ("sweep-lr-neg", ["sweep", "base.lr=-1", "--out", "{tmp}/s"], E, "lr"),
    ("sweep-lr-nan", ["sweep", "base.lr=.nan", "--out", "{tmp}/s"], E, "lr"),
    ("sweep-mismatch-nan", ["sweep", "mismatches=[noise:nan]", "--out", "{tmp}/s"], E, "strength"),
    ("sweep-steps-0", ["sweep", "base.steps=0", "--out", "{tmp}/s"], E, "steps"),
    ("sweep-seeds-0", ["sweep", "--seeds", "0", "--out", "{tmp}/s"], E, "--seeds"),
    ("sweep-workers-0", ["sweep", "--workers", "0", "--out", "{tmp}/s"], E, "--workers"),
    ("sweep-workers-negative", ["sweep", "--workers", "-1", "--out", "{tmp}/s"], E, "--workers"),
    ("sweep-out-is-file", ["sweep", "base.steps=1", "--seeds", "1", "--no-audit", "--out", "{tmp}/afile"], E, "afile"),
    ("sweep-config-malformed", ["sweep", "--config", "{tmp}/bad.yaml", "--out", "{tmp}/s"], E, "bad.yaml"),
    # audit
    ("audit-seeds-0", ["audit", "--seeds", "0", "--out", "{tmp}/a"], E, "--seeds"),
    ("audit-optimizer-unknown", ["audit", "--preset", "quick", "lr=1e-3", "optimizer=foo", "--out", "{tmp}/a"], E,
     "optimizer"),
    ("audit-policy-unknown", ["audit", "--preset", "quick", "policy=foo", "--out", "{tmp}/a"], E, "policy"),
    ("audit-k-above-vocab", ["audit", "--preset", "quick", "k=100000", "--out", "{tmp}/a"], E, "k:"),
    ("audit-k-sweep-above-vocab", ["audit", "--preset", "quick", "k_sweep=[100000]", "--out", "{tmp}/a"], E,
     "k_sweep"),
    ("audit-delta-nan", ["audit", "--preset", "quick", "delta=.nan", "--out", "{tmp}/a"], E, "delta"),
    ("audit-seeds-1e20", ["audit", "--preset", "quick", "seeds=1e20", "--out", "{tmp}/a"], E, "seeds"),
    ("audit-seeds-beyond-int64", ["audit", "--preset", "quick", "seeds=100000000000000000000", "--out", "{tmp}/a"],
     E, "seeds"),
    ("audit-sequences-not-groups", ["audit", "--preset", "quick", "sequences=100", "--out", "{tmp}/a"], E,
     "sequences"),
    ("audit-one-rule", ["audit", "--preset", "quick", "rules=[pdm_topk]", "--out", "{tmp}/a"], E, "rules"),
    ("audit-tolerance-negative", ["audit", "--preset", "quick", "tolerance=-1", "--out", "{tmp}/a"], E, "tolerance"),
    ("audit-modulus-0", ["audit", "--preset", "quick", "problem.token_mdp.modulus=0", "--out", "{tmp}/a"], E,
     "modulus"),
    ("audit-lr-inf", ["audit", "--preset", "quick", "lr=.inf", "--out", "{tmp}/a"], E, "lr"),
    # calibrate
    ("calibrate-delta-nan", ["calibrate", "--delta", "nan", "--out", "{tmp}/c"], E, "--delta"),
    ("calibrate-delta-dot-nan", ["calibrate", "--delta", ".nan", "--out", "{tmp}/c"], E, "--delta"),
    ("calibrate-delta-negative", ["calibrate", "--delta", "-1", "--out", "{tmp}/c"], E, "--delta"),
    ("calibrate-target-2", ["calibrate", "--target", "2", "--out", "{tmp}/c"], E, "--target"),
    ("calibrate-sequences-0", ["calibrate", "--sequences", "0", "--out", "{tmp}/c"], E, "--sequences"),
    ("calibrate-mismatch-nan", ["calibrate", "--mismatch", "noise:nan", "--out", "{tmp}/c"], E, "mismatch"),
    ("calibrate-run-not-json", ["calibrate", "--from-run", "{tmp}/badjson.jsonl", "--out", "{tmp}/c"], E,
     "badjson.jsonl:2"),
    ("calibrate-run-no-d", ["calibrate", "--from-run", "{tmp}/nokey.jsonl", "--out", "{tmp}/c"], E, "nokey.jsonl:1"),
    ("calibrate-run-nan", ["calibrate", "--from-run", "{tmp}/nan.jsonl", "--out", "{tmp}/c"], E, "nan.jsonl:2"),
    ("calibrate-run-missing", ["calibrate", "--from-run", "{tmp}/nowhere", "--out", "{tmp}/c"], E, "nowhere"),
    ("calibrate-run-works", ["calibrate", "--from-run", "{tmp}/good.jsonl", "--delta", "1e-1", "--out", "{tmp}/c"],
     OK, ""),
    # run records: every reader of a damaged audit.jsonl names the file and line (one reader)
    *[(f"{cmd[0]}-audit-{kind}", [a.replace("{run}", f"{{tmp}}/run-{kind}") for a in cmd], E, "audit.jsonl:2")
      for kind in ("truncated", "bytes", "nokey", "nonobject", "step-abc")
      for cmd in (["mechanism", "{run}", "--out", "{tmp}/m"], ["transfer", "{run}", "--out", "{tmp}/t"],
                  ["calibrate", "--from-run", "{run}", "--out", "{tmp}/c"])],
    ("prove-out-dev-full", ["prove", "--only", "ddot_closed_form", "--out", "/dev/full"], E, "/dev/full"),
    # demo, bench, prove, promote: every numeric option has its range
    ("demo-k-above-vocab", ["demo", "--vocab", "50", "--k", "100", "--out", "{tmp}/d.json"], E, "--k"),
    ("demo-tokens-0", [*_DEMO, "--tokens", "0"], E, "--tokens"),
    ("demo-vocab-1", [*_DEMO, "--vocab", "1", "--k", "1"], E, "--vocab"),
    ("demo-delta-nan", [*_DEMO, "--delta", "nan"], E, "--delta"),
    ("demo-delta-negative", [*_DEMO, "--delta", "-1"], E, "--delta"),
    ("demo-delta-inf", [*_DEMO, "--delta", ".inf"], E, "--delta"),
    ("demo-seed-beyond-int64", [*_DEMO, "--seed", "100000000000000000000"], E, "--seed"),
    ("demo-scientific-works", [*_DEMO, "--delta", "5e-2", "--tokens", "6.4e1"], OK, ""),
    ("bench-repeat-0", [*_BENCH, "--repeat", "0"], E, "--repeat"),
    ("bench-repeat-negative", [*_BENCH, "--repeat", "-1"], E, "--repeat"),
    ("bench-vocab-0", [*_BENCH, "--vocab", "0"], E, "--vocab"),
    ("bench-tokens-0", [*_BENCH, "--tokens", "0"], E, "--tokens"),
    ("bench-gather-tokens-0", [*_BENCH, "--gather-tokens", "0"], E, "--gather-tokens"),
    ("bench-k-above-vocab", [*_BENCH, "--k", "5000"], E, "--k"),
    ("bench-k-0", [*_BENCH, "--k", "0"], E, "--k"),
    ("bench-threads-negative", [*_BENCH, "--threads", "-1"], E, "--threads"),
    ("bench-loop-steps-0", [*_BENCH, "--loop-steps", "0"], E, "--loop-steps"),
    ("bench-loop-rounds-0", [*_BENCH, "--loop-rounds", "0"], E, "--loop-rounds"),
    ("bench-loop-ranks-negative", [*_BENCH, "--loop-ranks", "-1"], E, "--loop-ranks"),
    ("prove-seed-1e20", ["prove", "--seed", "1e20", "--list"], E, "--seed"),
    ("prove-seed-negative", ["prove", "--seed", "-1", "--list"], E, "--seed"),
    ("prove-no-such-claim", ["prove", "--only", "no_such_claim_xyz", "--list"], E, "no_such_claim_xyz"),
    ("promote-tie-tol-negative", ["promote", "{tmp}/sweep", "--base", "{q4b}", "--out", "{tmp}/p.yaml",
                                  "--tie-tol", "-1"], E, "--tie-tol"),
    ("promote-tie-tol-nan", ["promote", "{tmp}/sweep", "--base", "{q4b}", "--out", "{tmp}/p.yaml",
                             "--tie-tol", ".nan"], E, "--tie-tol"),
]


def _files(tmp: Path) -> None:
    tiny = TINY.read_text(encoding="utf-8")
    (tmp / "bad.yaml").write_text("model: [1, 2\nname: x\n")
    (tmp / "evil.yaml").write_text('model: !!python/object/apply:os.system ["echo pwned"]\n')
    (tmp / "dup.yaml").write_text(tiny + "\nseed: 5\n")
    bomb = "\nprovenance:\n  metrics:\n    l0: &l0 [x, x, x, x, x, x, x, x, x]\n"
    bomb += "".join(f"    l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 10))
    (tmp / "bomb.yaml").write_text(tiny + bomb)
    (tmp / "deep.yaml").write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "lr: 0.0003" in tiny
    (tmp / "sci.yaml").write_text(tiny.replace("lr: 0.0003", "lr: 3e-4"))
    (tmp / "sci-sweep.yaml").write_text("base:\n  lr: 1e-3\nrules: []\n")
    (tmp / "dup-sweep.yaml").write_text("rules: [none]\nrules: [pdm_topk]\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "afile").write_text("not a directory\n")
    (tmp / "badjson.jsonl").write_text('{"d": 0.1, "mu_tail": 0.01}\n{"d": \n')
    (tmp / "nokey.jsonl").write_text('{"mu_tail": 0.01}\n')
    (tmp / "nan.jsonl").write_text('{"d": 0.1, "mu_tail": 0.01}\n{"d": NaN, "mu_tail": 0.01}\n')
    good_line = json.dumps({"step": 0, "seed": 0, "rules": ["dppo_topk_kl", "pdm_topk"], "delta": 0.15, "k": 20})
    for kind, bad in (("truncated", b'{"step": 1, "rules": ["dppo'), ("bytes", b'{"step": 1, "x": "\xff\xfe"}'),
                      ("nokey", b'{"seed": 0, "rules": [], "delta": 0.15, "k": 20}'), ("nonobject", b"[1, 2, 3]"),
                      ("step-abc", b'{"step": "abc", "rules": [], "delta": 0.15, "k": 20}')):
        run = tmp / f"run-{kind}"
        run.mkdir()
        (run / "audit.jsonl").write_bytes(good_line.encode() + b"\n" + bad + b"\n")
        (run / "mismatch_sample.jsonl").write_text("".join(json.dumps({"d": 0.01 * i, "mu_tail": 0.01}) + "\n"
                                                           for i in range(40)))
    (tmp / "good.jsonl").write_text("".join(json.dumps({"d": 0.01 * i, "mu_tail": 0.01, "adv": (-1) ** i}) + "\n"
                                            for i in range(40)))


#: Runs each case as ``pdm_lab.cli.main.main(argv)`` in a forked child (its own process group,
#: stdout/stderr to files, exit status as the process's), killing it at the timeout.
RUNNER = r"""
import json, os, signal, sys, time, traceback
import pdm_lab.cli.main as cli
import pdm_lab.envs.transfer.calibrate, pdm_lab.envs.commands, pdm_lab.proofs.commands  # noqa: F401
import pdm_lab.scaling.commands, pdm_lab.scaling.dryrun, pdm_lab.scaling.launch  # noqa: F401
import pdm_lab.tools.bench, pdm_lab.tools.demo  # noqa: F401
from transformers import AutoTokenizer  # noqa: F401  (the paper-config cases read a tokenizer)
cases, timeout = json.load(sys.stdin), float(sys.argv[1])
results = {}
for case in cases:
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        # the parent ran torch ops at import (rule registration checks): an OpenMP pool must not
        # be reused across fork, so the child computes on one thread (a user's command is a fresh process)
        import torch; torch.set_num_threads(1)
        os.chdir(case["cwd"])
        os.dup2(os.open(case["cwd"] + "/.stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(case["cwd"] + "/.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.stdout, sys.stderr = os.fdopen(1, "w"), os.fdopen(2, "w")
        try:
            code = cli.main(case["argv"])
        except SystemExit as stop:
            code = stop.code
            if isinstance(code, str):
                print(code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 99
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(int(code or 0))
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() - start > timeout:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = None
            break
        time.sleep(0.01)
    try:
        os.killpg(pid, signal.SIGKILL)  # anything the case left running
    except ProcessLookupError:
        pass
    results[case["name"]] = {"rc": rc, "seconds": round(time.monotonic() - start, 2)}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory):
    from test_scaling_config import make_fake_model

    return make_fake_model(tmp_path_factory.mktemp("cli_model") / "model")


def run_cases(cases: list[tuple], tmp_root: Path, model: Path | None = None,
              timeout_s: float = CASE_TIMEOUT_S) -> dict[str, dict]:
    """Run `cases` (rows of ``TABLE``); per case: rc (None: killed after `timeout_s`), stdout, stderr."""
    env = dict(os.environ, PDM_LAB_CACHE=str(tmp_root / "cache"), PYTHONUNBUFFERED="1")
    env.pop("PDM_LAB_DEBUG", None)
    jobs = []
    for name, argv, _, _ in cases:
        tmp = tmp_root / name
        tmp.mkdir(exist_ok=True)
        _files(tmp)
        args = [a.format(tmp=tmp, tiny=TINY, q4b=Q4B, model=model) for a in argv]
        jobs.append({"name": name, "argv": args, "cwd": str(tmp)})
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(timeout_s)], input=json.dumps(jobs),
                          capture_output=True, text=True, env=env, cwd=tmp_root,
                          timeout=120 + 2 * timeout_s * len(jobs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, res in results.items():
        res["stdout"] = (tmp_root / name / ".stdout").read_text()
        res["stderr"] = (tmp_root / name / ".stderr").read_text()
    return results


def verdict(kind: str, must_name: str, res: dict) -> str:
    """``ok`` when the case behaved; else what went wrong (a hang, a traceback, nonsense accepted…)."""
    lines = [ln for ln in res["stderr"].splitlines() if ln.strip()]
    if res["rc"] is None:
        return f"hang (killed after {CASE_TIMEOUT_S} s)"
    if "Traceback" in res["stderr"] + res["stdout"]:
        return "traceback"
    if kind == OK:
        return "ok" if res["rc"] == 0 else f"valid input refused (status {res['rc']}): {lines[-1:]}"
    if res["rc"] == 0:
        return "nonsense accepted (status 0)"
    if res["rc"] != 2:
        return f"status {res['rc']}, not 2"
    if len(lines) != 1:
        return f"{len(lines)} lines on stderr, not 1"
    return "ok" if must_name in lines[0] else f"does not name {must_name!r}: {lines[0]}"


def test_every_bad_input_is_one_line_and_status_2(tmp_path, fake_model):
    holder = DirLock(tmp_path / "run-dir-locked" / "locked", what="run directory")
    holder.acquire()  # a live holder (this process) for the locked-run-dir case
    try:
        results = run_cases(TABLE, tmp_path, fake_model)
    finally:
        holder.release()
    table = [{"case": name, "rc": results[name]["rc"], "s": results[name]["seconds"],
              "verdict": verdict(kind, must, results[name]),
              "line": (results[name]["stderr"].strip().splitlines() or [""])[-1][:200]}
             for name, _, kind, must in TABLE]
    print(json.dumps(table, indent=1, ensure_ascii=False))
    bad = [row for row in table if row["verdict"] != "ok"]
    assert not bad, json.dumps(bad, indent=1, ensure_ascii=False)
    assert not (tmp_path / "yaml-python-tag" / "pwned").exists()
    assert all(not (tmp_path / name / "s").exists() for name, argv, *_ in TABLE if argv[0] == "sweep")


def test_the_verdict_catches_each_failure_mode():
    """Planted failures: each way a case can go wrong is reported, not passed."""
    one = {"rc": 2, "stdout": "", "stderr": "pdm-lab x: error: --k: must be ≥ 1\n"}
    assert verdict(E, "--k", one) == "ok"
    assert verdict(E, "--k", {**one, "rc": None}).startswith("hang")
    assert verdict(E, "--k", {**one, "stderr": "Traceback (most recent call last):\n"}) == "traceback"
    assert verdict(E, "--k", {**one, "rc": 0}).startswith("nonsense accepted")
    assert verdict(E, "--k", {**one, "rc": 70}).startswith("status 70")
    assert verdict(E, "--k", {**one, "stderr": one["stderr"] * 2}).startswith("2 lines")
    assert verdict(E, "--vocab", one).startswith("does not name")
    assert verdict(OK, "", {**one, "rc": 2}).startswith("valid input refused")


def test_runner_kills_a_hang_and_reports_the_status(tmp_path):
    """The runner's own guards: a case that never returns is killed at the timeout (rc None), and
    a case's exit status is the process's."""
    plugin = tmp_path / "sleepy_plugin.py"
    plugin.write_text("import time\ntime.sleep(3600)\n")
    cases = [("hangs", ["train", "--config", "{tiny}", f"plugins=[{plugin}]"], E, ""),
             ("exits-2", ["demo", "--tokens", "0"], E, "--tokens")]
    # a short timeout: the guard is the same at any length; the forked case starts warm (< 1 s)
    results = run_cases(cases, tmp_path, timeout_s=5)
    assert results["hangs"]["rc"] is None and results["hangs"]["seconds"] >= 5
    assert results["exits-2"]["rc"] == 2 and verdict(E, "--tokens", results["exits-2"]) == "ok"
