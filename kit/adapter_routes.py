"""adapter_routes.py - the server's LoRA adapters (Chapter 17): named at start, loaded at run time.

`--lora-modules NAME=PATH ...` names adapters as the server starts (vLLM's flag). With
`--lora-dir DIR` (and an `--admin-key`), vLLM's two runtime routes are on as well:

    POST /v1/load_lora_adapter    {"lora_name": "pirate", "lora_path": "pirate-r8"}
    POST /v1/unload_lora_adapter  {"lora_name": "pirate"}

Every API key here is a tenant, so only the admin key may call them (server_ops.authorized), and
a path is read only when it lies under --lora-dir: a key must never make the server read an
arbitrary file. At most `max_cpu_loras` adapters are loaded; unloading one lets the requests that
run with it finish, and a new request that names it gets a 404, as for any unknown model.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kit.openai_api import APIError

RUNTIME_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")   # the admin key's only
MAX_NAME_CHARS = 128


def next_lora_id(engine) -> int:
    """An id no adapter the engine holds has (vLLM's lora_int_id, from 1)."""
    return max((a.lora_int_id for a in engine.list_loras()), default=0) + 1


def add_lora_modules(engine, modules: list[str]) -> None:
    """Each NAME=PATH read and checked now, named as a model a request may pick."""
    from minivllm.lora import LoRARequest   # only a server that serves adapters needs it

    if not modules:
        return
    if not engine.capabilities().serves_adapters:
        raise ValueError("--lora-modules needs an engine that serves adapters: minivllm:LLM with --enable-lora")
    for i, module in enumerate(modules, start=next_lora_id(engine)):
        name, sep, path = module.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {module!r}")
        engine.add_lora(LoRARequest(name, i, path))


class LoadLoRA(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")   # no field is ignored: an unknown one is refused
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[^\s/]+$")
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False   # vLLM's: replace an adapter of that name with the folder's weights


class UnloadLoRA(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_int_id: int | None = Field(None, ge=1)


def folder_under(lora_dir: Path, lora_path: str) -> Path:
    """lora_path, relative to --lora-dir or absolute, resolved (symbolic links and '..' followed):
    it must lie under --lora-dir."""
    root = lora_dir.resolve()
    folder = (root / lora_path).resolve()
    if not folder.is_relative_to(root):
        raise APIError(400, f"lora_path must lie under the server's --lora-dir ({root})", param="lora_path")
    if not folder.is_dir():
        raise APIError(404, f"no adapter folder {lora_path!r} under --lora-dir", param="lora_path",
                       code="adapter_not_found")
    return folder


def install_runtime_updates(app: FastAPI, engine, lora_dir: str | Path, model_name: str) -> None:
    """vLLM's load and unload routes, reading adapters only from lora_dir."""
    from minivllm.lora import LoRARequest

    lora_dir = Path(lora_dir)
    if not lora_dir.is_dir():
        raise ValueError(f"--lora-dir {lora_dir} is not a folder")
    if not engine.capabilities().serves_adapters:
        raise ValueError("--lora-dir needs an engine that serves adapters: minivllm:LLM with --enable-lora")

    async def load_lora_adapter(body: LoadLoRA):
        held = {a.lora_name: a for a in engine.list_loras()}
        if body.lora_name == model_name:
            raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
        if body.lora_name in held and not body.load_inplace:
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.",
                           param="lora_name", code="adapter_exists")
        if body.lora_name not in held and len(held) >= engine.lora.max_cpu_loras:
            raise APIError(400, f"max_cpu_loras={engine.lora.max_cpu_loras} adapters are loaded; "
                                "unload one first", param="lora_name", code="too_many_adapters")
        folder = folder_under(lora_dir, body.lora_path)
        if body.lora_name in held:   # in place: running requests keep the weights they started with
            engine.remove_lora(held[body.lora_name].lora_int_id)
        try:   # the disk read and the checks, off the event loop
            await run_in_threadpool(engine.add_lora, LoRARequest(body.lora_name, next_lora_id(engine), str(folder)))
        except ValueError as exc:
            raise APIError(400, f"cannot load {body.lora_name!r}: {exc}", param="lora_path") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    # --8<-- [start:unload]
    async def unload_lora_adapter(body: UnloadLoRA):
        held = [a for a in engine.list_loras() if a.lora_name == body.lora_name
                and body.lora_int_id in (None, a.lora_int_id)]
        if not held:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="adapter_not_found")
        engine.remove_lora(held[0].lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
    # --8<-- [end:unload]

    answers = {200: {"description": "done"}, 400: {"description": "refused, with the reason"},
               401: {"description": "not the admin key"}, 404: {"description": "no such adapter or folder"}}
    app.post(RUNTIME_ROUTES[0], responses=answers)(load_lora_adapter)
    app.post(RUNTIME_ROUTES[1], responses=answers)(unload_lora_adapter)
