"""The HTTP edge: aiohttp handlers per API family, built by `create_app(settings)`."""
