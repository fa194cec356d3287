"""The REST shim: FastAPI over the job store (``stepline up`` serves it with uvicorn)."""
