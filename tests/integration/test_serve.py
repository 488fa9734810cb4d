"""`cascade-ray serve` end to end: a real Serve app on a loopback port, a real HTTP client.

One Serve app for the module (model A = `trained_run`); the reload test swaps it to model B (the
same pipeline with a retrained classifier) under load; the object-storage tests serve the
copy on moto S3.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from runs import train_debug_run

from cascade_ray.errors import CascadeError
from cascade_ray.tools.inference import load_cascade

pytest.importorskip("ray.serve")  # the `serve` extra; CI installs it with `test`


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: bytes | None = None, timeout: float = 30.0) -> tuple[int, dict, str]:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            return response.status, json.loads(text), text
    except urllib.error.HTTPError as exc:
        text = exc.read().decode()
        return exc.code, json.loads(text), text


def _predict(url: str, rows) -> tuple[int, dict, str]:
    return _http(f"{url}/predict", json.dumps({"inputs": rows}).encode())


@pytest.fixture(scope="module")
def second_run(trained_run, tmp_path_factory):
    """Model B: the same pipeline and spec with another classifier: a copy of `trained_run` resumed
    by the CLI with a changed classifier learning rate (its upstream stages are reused, so one stage
    is trained; other weights, another fingerprint)."""
    storage = tmp_path_factory.mktemp("second")
    shutil.copytree(trained_run, storage / "debug")
    return train_debug_run(storage, "stages[2].solver.lr=3e-3", "--resume")


@pytest.fixture(scope="module")
def served(s3, trained_run, second_run, ray_session):
    """The app serving model A on a free loopback port (s3 first: Ray's processes get its env)."""
    from ray import serve

    from cascade_ray.tools.serve_control import start_serving

    serving = start_serving(
        str(trained_run), port=_free_port(), replicas=1, max_batch_size=16, batch_wait_ms=20, max_rows=64
    )
    yield serving
    serve.shutdown()


@pytest.fixture(scope="module")
def rows():
    from sklearn.datasets import load_digits

    return load_digits().data[:40].reshape(-1, 1, 8, 8).astype(np.float32)


def test_predictions_match_load_cascade_and_name_the_model(served, trained_run, rows):
    want = load_cascade(trained_run).predict(rows)
    status, body, _ = _predict(served.url, rows.tolist())
    assert status == 200
    assert body["predictions"] == want["prediction"].tolist()
    np.testing.assert_allclose(body["probabilities"], want["probabilities"], rtol=1e-5, atol=1e-6)
    assert len(body["labels"]) == len(rows)
    assert body["model"] == served.model and body["model"]["run"] == str(trained_run)
    flat = _predict(served.url, rows[:3].reshape(3, -1).tolist())  # flat rows of 64 values
    assert flat[0] == 200 and flat[1]["predictions"] == want["prediction"][:3].tolist()
    one = _predict(served.url, rows[0].reshape(-1).tolist())  # one flat row alone
    assert one[0] == 200 and one[1]["predictions"] == want["prediction"][:1].tolist()
    assert "warning" not in body and "warning" not in one[1]
    scaled = _predict(served.url, (rows[:3] / 16).tolist())  # the model normalizes raw pixels itself
    assert scaled[0] == 200 and "look rescaled" in scaled[1]["warning"]


BAD = [
    ("shape", json.dumps({"inputs": [[1.0, 2.0, 3.0]]}).encode(), "shape"),
    ("strings", json.dumps({"inputs": [["a"] * 64]}).encode(), "numbers"),
    ("nan", json.dumps({"inputs": [[math.nan] * 64]}).encode(), "NaN"),
    ("missing key", json.dumps({"rows": [[0.0] * 64]}).encode(), "unknown key 'rows'"),
    ("no inputs", b"{}", 'no "inputs"'),
    ("not json", b"{inputs: [1", "not JSON"),
    ("not a list", json.dumps({"inputs": 3}).encode(), "non-empty list"),
    ("empty", json.dumps({"inputs": []}).encode(), "non-empty list"),
    ("too many rows", json.dumps({"inputs": [[0.0] * 64] * 65}).encode(), "at most 64"),
    ("ragged", json.dumps({"inputs": [[0.0] * 64, [0.0] * 3]}).encode(), "different lengths"),
]


@pytest.mark.parametrize(("case", "body", "reason"), BAD, ids=[c[0] for c in BAD])
def test_a_bad_request_is_a_400_with_the_reason(served, case, body, reason):
    status, answer, text = _http(f"{served.url}/predict", body)
    assert status == 400, (case, text)
    assert reason in answer["error"], answer
    assert "Traceback" not in text and set(answer) == {"error"}


def test_bad_requests_in_a_batch_do_not_fail_the_good_ones(served, rows):
    bodies = [json.dumps({"inputs": rows[:2].tolist()}).encode(), json.dumps({"inputs": [[1.0]]}).encode()] * 8
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda b: _http(f"{served.url}/predict", b), bodies))
    assert [a[0] for a in answers] == [200, 400] * 8


def test_health_info_and_unknown_routes(served):
    status, health, _ = _http(f"{served.url}/healthz")
    assert status == 200 and health["status"] == "ok" and health["fingerprint"] == served.model["fingerprint"]
    status, info, _ = _http(f"{served.url}/info")
    assert status == 200
    assert info["model"]["input_shape"] == [1, 8, 8] and info["model"]["target_kind"] == "class"
    assert info["model"]["out_width"] == 10 and info["config"]["max_batch_size"] == 16
    assert _http(f"{served.url}/nope")[0] == 404
    status, answer, _ = _http(f"{served.url}/info", b"{}")  # POST
    assert status == 405 and "POST /predict" in answer["error"]


def test_concurrent_requests_are_batched(served, rows):
    before = _http(f"{served.url}/info")[1]["stats"]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: _predict(served.url, rows[i : i + 1].tolist()), range(32)))
    assert all(a[0] == 200 for a in answers)
    stats = _http(f"{served.url}/info")[1]["stats"]
    assert stats["requests"] - before["requests"] == 32
    assert stats["batches"] - before["batches"] < 32  # some forward passes took several requests
    assert stats["largest_batch"] > 1


def test_reload_under_load_answers_every_request(served, second_run, rows):
    from cascade_ray.tools.serve_control import reload_serving

    a = served.model["fingerprint"]
    pid_before = _http(f"{served.url}/info")[1]["pid"]
    stop, results = threading.Event(), []
    lock = threading.Lock()

    def client(i: int) -> None:
        deadline = time.monotonic() + 120
        for n in range(500):
            if stop.is_set() or time.monotonic() > deadline:
                return
            status, body, _ = _predict(served.url, rows[(i + n) % 40 : (i + n) % 40 + 1].tolist())
            with lock:
                results.append((time.monotonic(), status, body.get("model", {}).get("fingerprint")))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    identity = reload_serving(str(second_run), name=served.name, log=lambda _: None)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    b = identity["fingerprint"]
    assert b != a and identity["run"] == str(second_run)
    assert results and all(status == 200 for _, status, _ in results), {s for _, s, _ in results}
    seen = [fp for _, _, fp in sorted(results)]
    assert set(seen) == {a, b} and seen[0] == a and seen[-1] == b
    first_b = seen.index(b)
    assert all(fp == b for fp in seen[first_b + 8 :])  # after the swap, only B (8: requests in flight then)
    info = _http(f"{served.url}/info")[1]
    assert info["pid"] == pid_before and info["stats"]["loads"] == 2  # reconfigured in place: same process


def test_a_run_that_does_not_load_is_refused_and_the_old_model_stays(served, tmp_path):
    from cascade_ray.tools.serve_control import reload_serving

    before = _http(f"{served.url}/healthz")[1]
    with pytest.raises(CascadeError, match="not a finished run"):
        reload_serving(str(tmp_path), name=served.name, log=lambda _: None)
    with pytest.raises(CascadeError, match="no app 'other'"):
        reload_serving(before["run"], name="other", log=lambda _: None)
    after = _http(f"{served.url}/healthz")[1]
    assert after["fingerprint"] == before["fingerprint"] and after["last_error"] is None


def test_a_run_on_object_storage_is_served(served, trained_run, trained_run_s3, rows):
    from ray import serve

    from cascade_ray.tools.serve_control import reload_serving, start_serving

    want = load_cascade(trained_run).predict(rows[:5])["prediction"].tolist()
    reload_serving(trained_run_s3, name=served.name, log=lambda _: None)  # the replica reads S3 itself
    status, body, _ = _predict(served.url, rows[:5].tolist())
    assert status == 200 and body["model"]["run"] == trained_run_s3 and body["predictions"] == want
    serve.delete(served.name)  # and started from S3 directly
    port = int(served.url.rsplit(":", 1)[1])
    fresh = start_serving(trained_run_s3, port=port, name=served.name)
    status, body, _ = _predict(fresh.url, rows[:5].tolist())
    assert status == 200 and body["model"]["run"] == trained_run_s3 and body["predictions"] == want
