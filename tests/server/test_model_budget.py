"""LearnedLimits (proxy/server/model_budget.py): the store read on first use and after the
TTL, written only when the correction moved meaningfully or enough answers piled up,
and its stored JSON read back defensively; window discovery's answer parsing."""

from __future__ import annotations

from proxy.core.budget import Learned, Sample
from proxy.server.discovery import window_in_lmstudio, window_in_models, window_in_show
from proxy.server.model_budget import WRITE_EVERY, LearnedLimits, from_state, to_state
from proxy.store.base import LearnedRecord

KEY = ("acme", "http://vllm/v1", "qwen")
NOW = "2026-01-01T00:00:00+00:00"


class CountingStore:
    """The two store methods LearnedLimits uses, counting calls."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, str], LearnedRecord] = {}
        self.reads = self.writes = 0

    async def learned_get(self, tenant: str, upstream: str, model: str) -> LearnedRecord | None:
        self.reads += 1
        return self.rows.get((tenant, upstream, model))

    async def learned_put(self, record: LearnedRecord) -> None:
        self.writes += 1
        self.rows[(record.tenant, record.upstream, record.model)] = record


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_the_store_is_read_once_per_ttl() -> None:
    store, clock = CountingStore(), Clock()
    limits = LearnedLimits(ttl=60, monotonic=clock)
    for _ in range(5):
        await limits.load(KEY, store)  # type: ignore[arg-type]
    assert store.reads == 1
    clock.now = 61
    await limits.load(KEY, store)  # type: ignore[arg-type]
    assert store.reads == 2


async def test_writes_are_debounced() -> None:
    store = CountingStore()
    limits = LearnedLimits()
    steady = Learned(ratio=1.35, overhead=14.0, answers=1)
    limits.put(KEY, steady)
    await limits.save(KEY, store, NOW)  # type: ignore[arg-type]
    assert store.writes == 1  # the first correction is written at once
    for i in range(WRITE_EVERY - 1):
        limits.put(KEY, Learned(ratio=1.351, overhead=14.0, answers=2 + i))
        await limits.save(KEY, store, NOW)  # type: ignore[arg-type]
    assert store.writes == 1  # the ratio moved by under 1%: nothing written
    limits.put(KEY, Learned(ratio=1.351, overhead=14.0, answers=99))
    await limits.save(KEY, store, NOW)  # type: ignore[arg-type]
    assert store.writes == 2  # WRITE_EVERY answers piled up
    limits.put(KEY, Learned(ratio=1.5, overhead=14.0, answers=100))
    await limits.save(KEY, store, NOW)  # type: ignore[arg-type]
    assert store.writes == 3  # a meaningful change is written at once


async def test_another_replicas_correction_is_read_after_the_ttl() -> None:
    store, clock = CountingStore(), Clock()
    mine = LearnedLimits(monotonic=clock)
    await mine.load(KEY, store)  # type: ignore[arg-type]
    store.rows[KEY] = LearnedRecord(*KEY, to_state(Learned(ratio=1.4, answers=7)), NOW)
    clock.now = 1000
    got = await mine.load(KEY, store)  # type: ignore[arg-type]
    assert got is not None and got.ratio == 1.4 and got.answers == 7


def test_the_stored_state_round_trips_and_bad_values_are_left_out() -> None:
    learned = Learned(
        window=8192,
        ratio=1.35,
        overhead=14.0,
        discovered=8192,
        answers=3,
        samples=(Sample(100, 2, 163),),
    )
    assert from_state(to_state(learned)) == learned
    bad = from_state(
        {
            "window": -3,
            "ratio": "x",
            "overhead": float("nan"),
            "answers": True,
            "samples": [[1, 2], "x", [1, 2, -1]],
        }
    )
    assert bad == Learned()


def test_listed_windows_in_each_providers_shape() -> None:
    # vLLM ModelCard.max_model_len (vllm/entrypoints/openai/protocol.py)
    vllm = {"object": "list", "data": [{"id": "q", "object": "model", "max_model_len": 8192}]}
    assert window_in_models(vllm, "q") == 8192
    assert window_in_models(vllm, "other") is None
    # OpenRouter's model: context_length, and top_provider.context_length
    assert window_in_models({"data": [{"id": "q", "context_length": 32768}]}, "q") == 32768
    top = {"data": [{"id": "q", "top_provider": {"context_length": 4096}}]}
    assert window_in_models(top, "q") == 4096
    # LM Studio's max_context_length (lmstudio.ai docs, REST API v0 models)
    assert window_in_models({"data": [{"id": "q", "max_context_length": 131072}]}, "q") == 131072
    assert window_in_models({"data": "nope"}, "q") is None
    assert window_in_models([1, 2], "q") is None


def test_ollamas_show_gives_num_ctx_first_then_the_models_length() -> None:
    # Ollama /api/show: parameters as "name value" lines, model_info "<arch>.context_length"
    both = {
        "parameters": 'stop "<|eot_id|>"\nnum_ctx 8192',
        "model_info": {"llama.context_length": 131072},
    }
    assert window_in_show(both) == 8192
    assert (
        window_in_show(
            {"model_info": {"general.architecture": "qwen2", "qwen2.context_length": 32768}}
        )
        == 32768
    )
    assert window_in_show({"parameters": "num_ctx lots"}) is None
    assert window_in_show("html") is None


class DownStore(CountingStore):
    async def learned_get(self, tenant: str, upstream: str, model: str) -> LearnedRecord | None:
        from proxy.store.base import StoreUnavailable

        self.reads += 1
        raise StoreUnavailable("down")


async def test_a_store_that_is_down_is_not_asked_on_every_request() -> None:
    store = DownStore()
    limits = LearnedLimits()
    for _ in range(3):
        assert await limits.load(KEY, store) in (None, Learned())  # type: ignore[arg-type]
    assert store.reads == 1


def test_lm_studios_own_listing_gives_the_loaded_context_first() -> None:
    # LM Studio REST API, GET /api/v1/models (lmstudio.ai/docs/developer/rest/list)
    entry = {"type": "llm", "key": "qwen3-8b", "max_context_length": 131072}
    loaded = {
        **entry,
        "loaded_instances": [{"id": "qwen3-8b", "config": {"context_length": 16384}}],
    }
    assert window_in_lmstudio({"models": [loaded]}, "qwen3-8b") == 16384
    assert window_in_lmstudio({"models": [entry]}, "qwen3-8b") == 131072
    assert window_in_lmstudio({"models": [entry]}, "other") is None
    assert window_in_lmstudio({"method": "GET"}, "qwen3-8b") is None
