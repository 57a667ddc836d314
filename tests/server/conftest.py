import pytest

from parity.fixtures.models import ensure_fixture

from srv_helpers import start_server, stop_server


@pytest.fixture(scope="session")
def qwen_dir():
    return ensure_fixture("qwen3", "bfloat16")


@pytest.fixture(scope="session")
def llama_dir():
    return ensure_fixture("llama", "bfloat16")


@pytest.fixture(scope="session")
def srv(qwen_dir):
    """qwen3 fixture behind a real uvicorn server; its model can be scripted (`srv.forced`).
    One request at a time (`--batch 1`): a scripted model drives one row."""
    s = start_server(qwen_dir, forced=True, prompt_cache_bytes=256 << 20, batch=1)
    yield s
    stop_server(s)


@pytest.fixture
def forced(srv):
    yield srv.forced
    srv.forced.disarm()


@pytest.fixture(scope="session")
def oai(srv):
    from openai import OpenAI
    return OpenAI(base_url=srv.v1, api_key="sk-anything", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def claude(srv):
    from anthropic import Anthropic
    return Anthropic(base_url=srv.url, api_key="anything", max_retries=0, timeout=60)
