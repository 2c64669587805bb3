"""The HTTP API: pure asyncio I/O over Redis. It never tokenizes and never imports torch."""
