"""The ASGI app for uvicorn: `uvicorn backend.api.app:app`."""

from backend.api.main import create_app

app = create_app()
