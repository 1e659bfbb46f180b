import argparse
import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest

from minispec.cli import main as cli_main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "minispec", *args], capture_output=True, text=True, timeout=300)


def test_check_env_reports_each_dependency():
    r = _run("check-env")
    assert r.returncode == 0, r.stdout + r.stderr
    for dep in ("torch", "transformers", "safetensors", "gguf", "triton", "nbmake"):
        assert f"[OK] {dep}" in r.stdout
    assert "[INFO] CUDA" in r.stdout and "[INFO] Triton interpreter" in r.stdout
    assert "[INFO] linear kernel ('auto'," in r.stdout  # the prepacked kernel this machine chose


def test_check_env_fails_on_missing_dependency(monkeypatch):
    import io

    from minispec.lab import env

    monkeypatch.setattr(env, "REQUIRED", ["torch", "surely_not_a_module_xyz"])
    out = io.StringIO()
    assert env.check_env(out) == 1
    assert "[FAIL] surely_not_a_module_xyz" in out.getvalue()


def test_check_env_warns_without_failing_when_the_course_extra_is_missing(monkeypatch):
    """JupyterLab (the course extra) only opens the notebooks in a browser: missing, check-env says how to get
    it and still passes, since scripts, the tests and headless notebook runs work without it."""
    import io

    from minispec.lab import env

    monkeypatch.setattr(env, "REQUIRED", ["torch"])
    monkeypatch.setattr(env, "COURSE", {"surely_not_a_module_xyz": "open the notebooks: make lab"})
    out = io.StringIO()
    assert env.check_env(out) == 0
    assert "[WARN] surely_not_a_module_xyz not installed (ModuleNotFoundError): needed to open the notebooks: make lab" \
        in out.getvalue()


def test_demo_on_tiny_model_prints_tokens_per_second():
    r = _run("demo", "--model", "tiny-llama", "--max-new-tokens", "8", "--prompt", "hi", "--method", "vanilla")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("vanilla "))
    assert "tokens/s" in r.stdout and "(8 new tokens over 1 prompt," in r.stdout and row.split()[2:4] == ["1.00x", "1.00"]
    assert "for comparison" not in r.stdout  # vanilla is not run twice


def test_demo_shows_the_method_beside_vanilla():
    r = _run("demo", "--model", "tiny-llama", "--max-new-tokens", "12", "--prompt", "abcabcabc", "--method", "pld")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["vanilla"], ["pld"])}
    assert set(rows) == {"vanilla", "pld"} and rows["pld"][-1] == "yes"  # greedy: identical output on every prompt
    assert "(48 new tokens over 4 prompts," in r.stdout  # the prompt given and 3 of minispec's own, 12 tokens each
    assert "both warm, interleaved on 4 prompts" in r.stdout  # the first (cold) run printed the text; the table times warm runs


def test_the_demo_times_the_calibration_mix_on_other_prompts():
    """The demo's comparison: your prompt, then minispec's own mixed as auto's calibration mixes them (one
    in three reuses its input) without the prompts auto calibrated on."""
    from minispec.cli import compare_prompts
    from minispec.lab.calibrate import QUICK_PROMPTS
    from minispec.prompts import calibration_set, reuse_prompts

    got = compare_prompts("mine", 3)
    reuse = {p["prompt"] for p in reuse_prompts()}
    assert got[0] == "mine" and len(got) == 4 and len(set(got)) == 4
    assert not set(got) & set(calibration_set(QUICK_PROMPTS)) and sum(p in reuse for p in got) == 1
    assert compare_prompts("mine", 0) == ["mine"]


def test_demo_auto_calibrates_once_and_says_so(tmp_path):
    """Without a saved calibration, the demo calibrates this machine in one announced step (the linear kernel, then
    'auto'), saves both, and reads them back the next time (here no head loads, so every candidate is skipped and
    vanilla is the choice)."""
    import os

    from minispec.exact.kernels import onednn_available

    env = dict(os.environ, MINISPEC_CACHE=str(tmp_path))
    cmd = [sys.executable, "-m", "minispec", "demo", "--model", "tiny-llama", "--method", "auto", "--max-new-tokens",
           "4", "--prompt", "hi", "--drafter", "none-such", "--no-compare", "--threads", "1"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr
    announced = [line for line in first.stdout.splitlines() if line.startswith("calibrating")]
    assert announced == [f"calibrating this machine once at 1 thread: the faster linear kernel (seconds), then 'auto' for "
                         f"tiny-llama (a budget of about 30 s); saved under {tmp_path} and read by every later run ..."]
    assert "auto = vanilla (calibrated in" in first.stdout and "auto = vanilla (calibrated on this machine" in first.stdout
    assert len(list((tmp_path / "tune").glob("tiny-llama-*-1t-b1.json"))) == 1
    assert len(list((tmp_path / "linear_kernel").glob("*-1t.json"))) == int(onednn_available())
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert "calibrating" not in second.stdout and "auto = vanilla (calibrated on this machine" in second.stdout


def test_calibrate_measures_once_and_force_measures_again(tmp_path):
    """``python -m minispec calibrate``: the one explicit step (``make demo`` runs it on a machine's first demo);
    a second run keeps what is saved, ``--force`` measures again."""
    import json
    import os

    env = dict(os.environ, MINISPEC_CACHE=str(tmp_path))
    cmd = [sys.executable, "-m", "minispec", "calibrate", "--model", "tiny-llama", "--threads", "1"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr
    path = next((tmp_path / "tune").glob("tiny-llama-*-1t-b1.json"))
    assert "auto = vanilla (calibrated in" in first.stdout and json.loads(path.read_text())["choice"] == "vanilla"
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert "auto = vanilla (kept;" in again.stdout
    forced = subprocess.run(cmd + ["--force"], capture_output=True, text=True, timeout=300, env=env)
    assert forced.returncode == 0 and "auto = vanilla (calibrated in" in forced.stdout


def test_demo_rejects_an_empty_prompt():
    r = _run("demo", "--model", "tiny-llama", "--prompt", "   ")
    assert r.returncode == 2 and "the prompt is empty" in r.stderr


def test_demo_rejects_bad_sampling_parameters():
    r = _run("demo", "--model", "tiny-llama", "--top-p", "0")
    assert r.returncode == 2 and "top_p" in r.stderr


def test_check_env_flags_a_cuda_build_without_a_gpu(monkeypatch):
    import io

    import torch

    from minispec.lab import env

    monkeypatch.setattr(env, "REQUIRED", ["torch"])
    monkeypatch.setattr(env, "COURSE", {})  # the course extra's warning is another test's (CI installs no JupyterLab)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    out = io.StringIO()
    assert env.check_env(out) == 0
    assert "[WARN] torch" in out.getvalue() and "CUDA 12.8 build but no GPU" in out.getvalue()
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build: nothing to flag
    out = io.StringIO()
    env.check_env(out)
    assert "[WARN]" not in out.getvalue()


def test_default_threads_leave_busy_cores_alone():
    from minispec.lab.env import default_threads

    assert default_threads(cores=2, load=0.0) == 2
    assert default_threads(cores=2, load=1.0) == 1  # one busy process beside it: one thread, not a collapse
    assert default_threads(cores=2, load=5.0) == 1
    assert default_threads(cores=8, load=2.2) == 6
    assert default_threads(cores=2, idle=2.0) == 2 and default_threads(cores=2, idle=0.9) == 1
    assert default_threads(cores=2, idle=0.1) == 1 and default_threads(cores=8, idle=5.6) == 6


def test_idle_cores_are_measured_now_not_averaged_over_the_last_minute(tmp_path):
    from minispec.lab.env import _cpu_times, idle_cores

    readings = iter([(100, 1000), (250, 1200)])  # 150 of the 200 jiffies that passed were idle
    assert idle_cores(0.0, read=lambda: next(readings), cores=2) == 1.5
    assert idle_cores(0.0, read=lambda: None, cores=2) is None  # no /proc/stat: the caller falls back
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 1 5 80 4 0 0 0 0 0\ncpu0 5 0 2 40 2 0 0 0 0 0\n")
    assert _cpu_times(str(stat)) == (84, 100)
    assert _cpu_times(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("args, message", [
    (("demo", "--model", "tiny-llama", "--threads", "-3"), "argument --threads: must be at least 1, got -3"),
    (("bench", "--threads", "x"), "argument --threads: must be a whole number, got 'x'"),
    (("train", "eagle", "--threads", "0"), "argument --threads: must be at least 1, got 0"),
    (("profile", "--methods", "vanilla,zzz"), "unknown method 'zzz'"),
    (("profile", "--sizes", "0,x"), "--sizes: must be a whole number, got 'x'"),
    (("profile", "--reps", "0"), "argument --reps: must be at least 1, got 0"),
])
def test_bad_counts_and_methods_are_refused_by_name_before_anything_loads(args, message):
    """A bad --threads (any command), profile's methods, sizes or repetitions: exit 2 with the argument named,
    not a traceback from torch.set_num_threads or int() once the model has loaded."""
    r = _run(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


ROOT = Path(__file__).resolve().parents[1]


def _benchmark(name: str):
    """``benchmarks/NAME.py``'s main, called with argv (a main that reads ``sys.argv`` gets it there)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def main(argv):
        if module.main.__code__.co_argcount:
            return module.main(argv)
        with patch.object(sys, "argv", [spec.origin, *argv]):
            return module.main()
    return main


def _module(name: str, func: str = "main"):
    return lambda argv: getattr(importlib.import_module(name), func)(argv)


THREADS_COMMANDS = {  # a file that declares --threads -> how each of its commands parses argv
    "minispec/cli.py": [lambda argv, c=c: cli_main([c, *argv]) for c in ("demo", "tune", "bench")],
    "minispec/lab/profile.py": [_module("minispec.lab.profile")],
    "minispec/lab/gpu_suite.py": [_module("minispec.lab.gpu_suite")],
    "minispec/train/data.py": [_module("minispec.train.data")],
    **{f"minispec/train/{m}.py": [_module(f"minispec.train.{m}", "parse_args")]
       for m in ("distill_draft", "eagle", "eagle3", "medusa", "selfdistill")},
    **{f"benchmarks/{p.name}": [lambda argv, n=p.stem: _benchmark(n)(argv)]
       for p in sorted((ROOT / "benchmarks").glob("*.py")) if '"--threads"' in p.read_text()},
}


def test_every_threads_flag_takes_the_shared_thread_count_type():
    """Every ``--threads`` of minispec, its lab, its trainers and the benchmarks is parsed by
    ``minispec.lab.env.thread_count`` (or ``thread_counts`` for a list), and is in ``THREADS_COMMANDS`` below."""
    declared = {}
    for path in [*(ROOT / "minispec").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tools").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--threads"):
                kind = {k.arg: k.value for k in node.keywords}.get("type")
                declared.setdefault(str(path.relative_to(ROOT)), []).append(getattr(kind, "id", ast.dump(kind) if kind else None))
    assert declared and all(t in ("thread_count", "thread_counts") for ts in declared.values() for t in ts), declared
    assert set(declared) == set(THREADS_COMMANDS), set(declared) ^ set(THREADS_COMMANDS)


@pytest.mark.parametrize("value", ["0", "-2"])
@pytest.mark.parametrize("path", sorted(THREADS_COMMANDS))
def test_every_command_refuses_threads_below_one_by_name(path, value, capsys):
    """``--threads 0`` (once "one per idle core", now the flag left out) and negatives: every command exits 2 with
    argparse's message naming the flag, before it loads anything."""
    parse = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):  # a command that accepts the value stops here, having run nothing
        raise AssertionError(f"{path} accepted --threads {value}: {parse(self, args, namespace)}")

    for command in THREADS_COMMANDS[path]:
        with patch.object(argparse.ArgumentParser, "parse_args", parse_only), pytest.raises(SystemExit) as e:
            command(["--threads", value])
        assert e.value.code == 2
        assert f"argument --threads: must be at least 1, got {value}" in capsys.readouterr().err


def test_thread_count_parses_counts_and_lists():
    from minispec.args import thread_count, thread_counts

    assert thread_count("3") == 3 and thread_counts("1, 2") == [1, 2]
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            thread_count(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1, got 0"):
        thread_counts("1,0")
