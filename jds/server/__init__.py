"""OpenAI-compatible HTTP front end (aiohttp) over ``jds.engine``: routes, validation, SSE, metrics."""
