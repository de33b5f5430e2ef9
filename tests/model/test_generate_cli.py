"""The README's main job: offline generation on the embedded tiny default model."""

from __future__ import annotations

import os
import subprocess
import sys

from sglang_tpu_backend.generate import generate, main


def test_generate_cli_prints_the_text_the_library_generates():
    prompt = "Tell me about the sea."
    text, ids = generate(None, prompt, max_new_tokens=12)
    assert len(ids) >= 1
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_tpu_backend.generate", "--prompt", prompt,
         "--max-new-tokens", "12"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.rstrip("\n") == text
    assert "generated" in proc.stderr  # the timing log line


def test_generate_rejects_bad_arguments(capsys):
    assert main(["--prompt", "", "--no-chat", "--max-new-tokens", "4"]) == 2
    assert "prompt" in capsys.readouterr().err
