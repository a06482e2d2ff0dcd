"""Pushing a finished run to a local server that speaks the Hub endpoints huggingface_hub uses."""

import json
import subprocess
import sys

import pytest
from helpers import REPO, env
from hub_server import FakeHub

RECIPE = str(REPO / "recipes" / "tiny-pretrain.yaml")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pushme") / "run"
    command = [sys.executable, "-m", "hf_diloco.cli", "train", "--config", RECIPE, "--output_dir", str(out),
               "--max_steps", "6", "--inner_steps", "3", "--block_size", "64", "--eval_steps", "3",
               "--disable_tqdm", "true"]
    result = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def push(out, hub, *extra, token="hf_secret_token_123"):
    command = [sys.executable, "-m", "hf_diloco.cli", "push", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env={**env(), "HF_ENDPOINT": hub.url, "HF_TOKEN": token, "HF_HUB_OFFLINE": "0"})


def test_push_uploads_model_tokenizer_and_diloco_card(finished_run):
    with FakeHub() as hub:
        result = push(finished_run, hub, "--repo-id", "alice/tiny-diloco", "--private")
        assert result.returncode == 0, result.stderr[-3000:]
        files = hub.files["alice/tiny-diloco"]
        assert hub.repos["alice/tiny-diloco"]["visibility"] == "private"
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", "README.md", "training_curve.png",
                 "sync_rounds.jsonl"):
        assert name in files, sorted(files)
    assert not any(name.startswith(("checkpoint", "replica-", "runs")) for name in files)
    card = files["README.md"].decode()
    assert "- diloco" in card and "- hf-diloco" in card
    assert "| H, inner steps between syncs (`inner_steps`) | 3 | 500 |" in card
    assert "| outer learning rate (`outer_lr`) | 0.7 | 0.7 |" in card
    assert "![training curve](training_curve.png)" in card and files["training_curve.png"][:4] == b"\x89PNG"
    rounds = [json.loads(line) for line in files["sync_rounds.jsonl"].decode().splitlines()]
    assert [r["step"] for r in rounds] == [3, 6]
    assert all(t == "Bearer hf_secret_token_123" for t in hub.tokens)
    # The token never reaches the uploaded files, the run folder or the output.
    assert not any(b"hf_secret_token_123" in content for content in files.values())
    assert "hf_secret_token_123" not in result.stdout + result.stderr
    assert not any(b"hf_secret_token_123" in p.read_bytes() for p in finished_run.rglob("*") if p.is_file())


@pytest.mark.parametrize("repo_id,token,words", [
    ("my model", "hf_x", ["repo id", "not valid"]),
    ("alice/ok", "", ["no Hugging Face token"]),
])
def test_bad_push_input_is_one_sentence(finished_run, repo_id, token, words, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no stored login either
    with FakeHub() as hub:
        result = push(finished_run, hub, "--repo-id", repo_id, token=token)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert all(w in result.stderr for w in words), result.stderr
        assert hub.commits == []
