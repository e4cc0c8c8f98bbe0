"""Image tokens through the socket (issue 8 item 19): a data-URL image is counted at its
real size, as OpenAI counts it, on both APIs."""

from __future__ import annotations

from typing import Any

from tests import image_headers

ONE_PIXEL = image_headers.data_url(image_headers.png(1, 1))


def responses_input(*images: dict[str, Any]) -> list[dict[str, Any]]:
    content = [{"type": "input_text", "text": "What is in this picture?"}, *images]
    return [{"role": "user", "content": content}]


async def test_input_tokens_count_a_one_pixel_png_as_openai_does(proxy) -> None:
    """OpenAI counts a 1x1 PNG with `auto` detail as 255 tokens on gpt-4o (85 + one
    170-token tile); the proxy counted 1,453."""
    client = proxy.client()

    async def count(*images: dict[str, Any]) -> int:
        result = await client.responses.input_tokens.count(
            model="gpt-4o", input=responses_input(*images)
        )
        return result.input_tokens

    text_only = await count()
    auto = await count({"type": "input_image", "image_url": ONE_PIXEL, "detail": "auto"})
    unset = await count({"type": "input_image", "image_url": ONE_PIXEL})
    low = await count({"type": "input_image", "image_url": ONE_PIXEL, "detail": "low"})
    remote = await count({"type": "input_image", "image_url": "https://example.com/a.png"})
    assert (auto - text_only, unset - text_only, low - text_only) == (255, 255, 85)
    assert remote - text_only == 85 + 170 * 8  # unknown size: the documented worst case


async def test_chat_context_tokens_header_counts_the_real_image_size(proxy) -> None:
    client = proxy.client()
    wide = image_headers.data_url(image_headers.png(4000, 100))

    async def context_tokens(content: list[dict[str, Any]]) -> int:
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=[{"role": "user", "content": content}]
        )
        return int(raw.headers["x-threadkeeper-context-tokens"])

    text = {"type": "text", "text": "Describe it."}
    text_only = await context_tokens([text])
    with_image = await context_tokens([text, {"type": "image_url", "image_url": {"url": wide}}])
    assert with_image - text_only == 85 + 170 * 4  # 2048x51 after the fit: 4x1 tiles
