"""The media examples end to end, as a user runs them from a folder of their own: the models and media built by
examples/make_media.py, a pool of 2 workers on default settings, the image embedder over a folder and over the
same JPEGs as a Hugging Face Image Parquet (equal to each other and to a plain in-process loop), the Whisper
example over a folder of WAVs; a corrupt JPEG and a truncated WAV fail alone with their decoder's message."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import PY, ROOT

REASON = "the media examples' packages are not installed: .venv/bin/pip install -r examples/requirements-media.txt"
pytest.importorskip("transformers", reason=REASON)
pytest.importorskip("PIL", reason=REASON)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import make_media  # noqa: E402

PHOTOS, CLIPS = 14, 6   # files of each folder besides the bad one


def calque_in(env, cwd):
    """`python calque.py ARGS` from the user's folder: (exit code, stdout, stderr)."""
    def calque(*args):
        out = subprocess.run([PY, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=cwd, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode in (0, 1), out.stderr   # 1: some items failed
        return out
    return calque


def results(calque, out):
    """The JSONL results of the run a waiting submit names."""
    run_id = next(line.split()[1].rstrip(":") for line in out.stderr.splitlines() if line.startswith("run "))
    return [json.loads(line) for line in calque("runs", "results", run_id).stdout.splitlines()]


def in_process(handler, env):
    """The handler loaded in this process, as a plain loop of the user's own would load it."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        handler.load()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return handler


def decoder_error(collate, item):
    """What the decoder raises for `item`, as a failed item names it ("Type: message")."""
    with pytest.raises(Exception) as caught:
        collate([item])
    return f"{type(caught.value).__name__}: {caught.value}"


def test_image_example_over_a_folder_and_an_hf_parquet(local_env, tmp_path):
    make_media.build_image_model(str(tmp_path / "vit-model"))
    make_media.write_photos(str(tmp_path / "photos"), PHOTOS)
    good = (tmp_path / "photos" / "photo-00000.jpg").read_bytes()
    (tmp_path / "photos" / "corrupt.jpg").write_bytes(good[:len(good) // 2])   # cut in its scan data
    make_media.write_image_parquet(str(tmp_path / "images.parquet"), str(tmp_path / "photos"))
    env = {"IMAGE_MODEL_DIR": str(tmp_path / "vit-model"), "HF_HUB_OFFLINE": "1"}
    calque = calque_in(dict(local_env, **env), tmp_path)
    calque("pool", "create", "--model", "vit", "--handler", os.path.join(ROOT, "examples", "image_embed.py:ImageEmbed"),
           "--workers", "2")
    runs = [calque("submit", "--pool", "vit", "photos/", "--id-field", "path", "--claim-size", "4"),
            calque("submit", "--pool", "vit", "images.parquet", "--claim-size", "4")]
    assert all(out.returncode == 1 and f"{PHOTOS} items ok, 1 failed" in out.stdout for out in runs), runs
    by_file, by_row = (results(calque, out) for out in runs)
    calque("pool", "delete", "--model", "vit", "--yes")

    from image_embed import ImageEmbed
    model = in_process(ImageEmbed(), env)
    names = sorted(os.listdir(tmp_path / "photos"))   # the Parquet's row order
    files = {name: (tmp_path / "photos" / name).read_bytes() for name in names}
    assert sorted(line["path"] for line in by_file) == names and len(by_row) == len(names)
    error = decoder_error(model.collate, {"bytes": files["corrupt.jpg"]})
    for name, from_file, from_row in zip(names, sorted(by_file, key=lambda line: line["path"]), by_row):
        if name == "corrupt.jpg":   # alone, with Pillow's message, both ways
            assert error.startswith("OSError: ") and "truncated" in error, error
            assert from_file["error"] == from_row["error"] == error and "result" not in from_file, from_file
            continue
        want = model.embed(model.collate([{"bytes": files[name]}]))[0].numpy()
        assert want.shape == (192,)
        assert np.abs(np.array(from_file["result"]) - want).max() < 1e-4, name   # batched apart: float rounding
        assert np.abs(np.array(from_row["result"]) - want).max() < 1e-4, name


def test_audio_example_over_a_folder_of_wavs(local_env, tmp_path):
    make_media.build_audio_model(str(tmp_path / "whisper-model"))
    make_media.write_clips(str(tmp_path / "clips"), CLIPS)
    good = (tmp_path / "clips" / "clip-00000.wav").read_bytes()
    (tmp_path / "clips" / "short.wav").write_bytes(good[:len(good) // 3])   # cut in its frames
    env = {"AUDIO_MODEL_DIR": str(tmp_path / "whisper-model"), "HF_HUB_OFFLINE": "1"}
    calque = calque_in(dict(local_env, **env), tmp_path)
    calque("pool", "create", "--model", "whisper", "--handler",
           os.path.join(ROOT, "examples", "audio_whisper.py:Transcribe"), "--workers", "2")
    out = calque("submit", "--pool", "whisper", "clips", "--id-field", "path", "--claim-size", "3")
    assert out.returncode == 1 and f"{CLIPS} items ok, 1 failed" in out.stdout, out.stdout
    lines = {line["path"]: line for line in results(calque, out)}
    calque("pool", "delete", "--model", "whisper", "--yes")

    from audio_whisper import Transcribe
    model = in_process(Transcribe(), env)
    short = (tmp_path / "clips" / "short.wav").read_bytes()
    assert lines["short.wav"]["error"] == decoder_error(model.collate, {"bytes": short})
    assert lines["short.wav"]["error"].startswith("EOFError: WAV truncated: ")
    for name in sorted(lines):
        if name != "short.wav":
            want = model.transcribe(model.collate([{"bytes": (tmp_path / "clips" / name).read_bytes()}]))[0]
            got = lines[name]["result"]
            assert 1 <= len(got) <= 8 and got[:len(want)] == want.tolist(), (name, got, want)
