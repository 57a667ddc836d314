"""Pydantic models of every request body and response body of `engine-serve`.

FastAPI validates each request against its model (`server.routes` wires them to the
routes) and publishes them as the OpenAPI document at `/openapi.json`. A validation
error becomes a 400 in the protocol's own error shape (`server.errors.from_validation`).
"""
