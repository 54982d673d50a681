"""plait on Ray Serve: a local Ray instance serves the default model through `plait.deploy.ray`
(two replicas, plait's cache-aware request router) and answers OpenAI and native requests.
Skipped when `ray[serve]` is not installed (`pip install 'plait[ray]'`)."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the served name: the default GGUF file's stem


@pytest.fixture(scope="module")
def ray_url():
    import ray
    from ray import serve

    from plait.deploy.ray import build_app
    from plait.server.launch import free_port

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"max_total_tokens": 8192, "num_replicas": 2, "replica_cpus": 0.5}
        serve.run(build_app(args), name="plait", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_openai_requests_through_ray_serve(ray_url):
    from openai import OpenAI

    client = OpenAI(base_url=ray_url + "/v1", api_key="none")
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    whole = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0)
    assert streamed == whole.choices[0].text


def test_shared_prefix_stays_on_one_replica_and_errors_pass_through(ray_url):
    prefix = "You are a museum guide. " * 20
    metas = []
    for i in range(4):
        body = {
            "text": f"{prefix}Question {i}: what is on the wall?",
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        }
        metas.append(httpx.post(ray_url + "/generate", json=body, timeout=120).json()["meta_info"])
    # the router sends every request after the first to the replica that holds the prefix
    assert all(m["cached_tokens"] >= 0.8 * m["prompt_tokens"] for m in metas[1:]), metas
    bad = httpx.post(ray_url + "/generate", json={"text": "x", "sampling_params": {"top_p": 2}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
    assert httpx.get(ray_url + "/get_model_info").json()["model_path"]


def test_the_documented_serve_run_config_builds():
    import re
    from pathlib import Path

    import yaml

    from plait.deploy.ray import build_app

    doc = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", doc, flags=re.S).group(1))
    (application,) = config["applications"]
    assert application["import_path"] == "plait.deploy.ray:build_app"
    assert build_app(application["args"]) is not None
    with pytest.raises(ValueError, match="router.nope"):
        build_app({"router": {"nope": 1}})
    with pytest.raises(ValueError, match="page_size"):
        build_app({"page_size": 0})
