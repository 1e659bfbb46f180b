import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "minispec", *args], capture_output=True, text=True, timeout=300)


def test_check_env_reports_each_dependency():
    r = _run("check-env")
    assert r.returncode == 0, r.stdout + r.stderr
    for dep in ("torch", "transformers", "safetensors", "gguf", "triton", "nbmake"):
        assert f"[OK] {dep}" in r.stdout
    assert "[INFO] CUDA" in r.stdout and "[INFO] Triton interpreter" in r.stdout


def test_check_env_fails_on_missing_dependency(monkeypatch):
    import io

    from minispec import env

    monkeypatch.setattr(env, "REQUIRED", ["torch", "surely_not_a_module_xyz"])
    out = io.StringIO()
    assert env.check_env(out) == 1
    assert "[FAIL] surely_not_a_module_xyz" in out.getvalue()


def test_demo_on_tiny_model_prints_tokens_per_second():
    r = _run("demo", "--model", "tiny-llama", "--max-new-tokens", "8", "--prompt", "hi", "--method", "vanilla")
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and "8 new tokens" in r.stdout and "[vanilla greedy]" in r.stdout


def test_demo_runs_a_speculative_method():
    r = _run("demo", "--model", "tiny-llama", "--max-new-tokens", "12", "--prompt", "abcabcabc", "--method", "pld")
    assert r.returncode == 0, r.stderr
    assert "[pld greedy] 12 new tokens" in r.stdout


def test_demo_rejects_bad_sampling_parameters():
    r = _run("demo", "--model", "tiny-llama", "--top-p", "0")
    assert r.returncode == 2 and "top_p" in r.stderr
