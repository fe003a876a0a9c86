"""What ``POST /v1/adapters`` is sent, checked and stored: a LoRA adapter's two files.

The form (``multipart/form-data``) holds ``name`` (the adapter's part of ``base:adapter``),
``model`` (the base model) and two file parts, ``adapter_config`` (its ``adapter_config.json``)
and ``adapter_model`` (its ``adapter_model.safetensors``). The body is bounded before it is read
(``MAX_BODY_BYTES_BY_PATH``: ``MAX_ADAPTER_BYTES`` and the multipart framing, from its
``Content-Length``, or as a chunked body arrives) and the files as Django's parser streams them
(:class:`CappedUpload`, the request's only upload handler: never more than
``MAX_ADAPTER_BYTES`` of them is written to its temporary files). Every temporary file of an
upload is closed, and so deleted, as soon as the upload is stored or refused, whatever refused
it (:func:`received_form`), not when the request is garbage collected. Only their form is
checked here (a safetensors header, a JSON object); the Celery task checks the rest
(:mod:`gateway.adapter_validation`). Each upload is written to a folder of its own under
``ADAPTER_ROOT``, made new for it (:func:`tenants.adapters.new_upload_folder`): no upload ever
writes into a folder that exists, which another row (a shared adapter the operator registered
from a tenant's upload, say) may name. The folders are 0700 and the files 0600.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.core.files.uploadedfile import (
    InMemoryUploadedFile,
    TemporaryUploadedFile,
    UploadedFile,
)
from django.core.files.uploadhandler import FileUploadHandler
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.http import HttpRequest
from django.http.multipartparser import MultiPartParserError

from gateway.conf import platform_settings
from gateway.errors import APIError
from gateway.model_registry import Access, find, read_served_models
from tenants import adapter_check, adapters
from tenants.models import ADAPTER_NAME_MAX, ApiKey, LoraAdapter, valid_adapter_name

NAME, MODEL = "name", "model"
CONFIG, WEIGHTS = "adapter_config", "adapter_model"
FIELDS, FILES = (NAME, MODEL), (CONFIG, WEIGHTS)
# Longest part of a bad value repeated in an error.
MAX_ECHOED = 64


def _shown(value: str) -> str:
    return value if len(value) <= MAX_ECHOED else value[:MAX_ECHOED] + "..."


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, message, param=param, code=code)


def too_large(limit: int) -> APIError:
    """413: the adapter's files are over ``limit`` bytes (``MAX_ADAPTER_BYTES``)."""
    return APIError(413, f"The adapter's files are larger than the limit of {limit} bytes "
                         f"(MAX_ADAPTER_BYTES).", param=WEIGHTS, code="request_too_large",
                    should_retry=False, details={"limit_bytes": limit})


class FilesTooLarge(Exception):
    """The files of an upload passed their limit while they arrived."""


class CappedUpload(FileUploadHandler):
    """The upload handler of an adapter upload (the request's only one): it keeps each file
    part, in memory when the whole body is at most ``FILE_UPLOAD_MAX_MEMORY_SIZE`` (as Django's
    own handlers), else in a temporary file (``FILE_UPLOAD_TEMP_DIR``), and counts their bytes
    as Django's parser streams them. Once they pass ``limit`` the parse stops
    (:class:`FilesTooLarge`) before the chunk that passed it is written: no file it keeps ever
    holds more than ``limit`` bytes. It remembers every file it opened, complete or not, so that
    :meth:`close` closes (a temporary file: deletes) each one, whatever stopped the parse."""

    def __init__(self, request: HttpRequest, limit: int):
        super().__init__(request)
        self.limit = limit
        self.received = 0
        self.in_memory = False
        self.opened: list[UploadedFile] = []

    def handle_raw_input(self, input_data: Any, META: Any, content_length: int, boundary: Any,
                         encoding: str | None = None) -> None:
        self.in_memory = 0 <= content_length <= settings.FILE_UPLOAD_MAX_MEMORY_SIZE

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        super().new_file(*args, **kwargs)
        file: UploadedFile
        if self.in_memory:
            file = InMemoryUploadedFile(BytesIO(), self.field_name, self.file_name,
                                        self.content_type, 0, self.charset,
                                        self.content_type_extra)
        else:
            file = TemporaryUploadedFile(self.file_name or "", self.content_type, 0,
                                         self.charset, self.content_type_extra)
        self.opened.append(file)
        self.file = file  # the name Django's parser closes on a StopUpload

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        self.received += len(raw_data)
        if self.received > self.limit:
            raise FilesTooLarge
        self.file.write(raw_data)
        return None

    def file_complete(self, file_size: int) -> UploadedFile:
        self.file.seek(0)
        self.file.size = file_size
        return self.file

    def upload_interrupted(self) -> None:
        self.close()

    def close(self) -> None:
        """Close every file it opened: a temporary file is deleted, its disk space freed."""
        while self.opened:
            self.opened.pop().close()

@dataclass(frozen=True)
class Upload:
    """An upload's checked form: the adapter's ``name``, its ``base`` model and its two
    files."""

    name: str
    base: str
    config: UploadedFile
    weights: UploadedFile


@contextmanager
def received_form(request: HttpRequest) -> Iterator[tuple[dict[str, list[str]], Any]]:
    """The request's form fields and files (:func:`read_form`), for the ``with`` block; when it
    ends, however it ends (the upload stored, any refusal, an error), every file the upload
    opened is closed and, kept on disk, deleted at once."""
    handler = CappedUpload(request, platform_settings()["MAX_ADAPTER_BYTES"])
    try:
        yield read_form(request, handler)
    finally:
        handler.close()


def read_form(request: HttpRequest, handler: CappedUpload) -> tuple[dict[str, list[str]], Any]:
    """The request's form fields and files, parsed by ``handler`` alone (its files bounded by
    its limit, ``MAX_ADAPTER_BYTES``); the caller closes ``handler`` (:func:`received_form`).

    Raises:
        APIError: 413 :func:`too_large` for a ``Content-Length`` over the limit and its
            framing, or files over the limit; 400 for a body that is not a form.
    """
    limit = handler.limit
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > limit + settings.MULTIPART_OVERHEAD_BYTES:
        raise too_large(limit)
    request.upload_handlers = [handler]
    try:
        fields = {name: request.POST.getlist(name) for name in request.POST}
        return fields, request.FILES
    except FilesTooLarge as exc:
        raise too_large(limit) from exc
    except RequestDataTooBig as exc:
        raise APIError(400, "The form's fields other than the files are too large.",
                       code="invalid_request") from exc
    except (MultiPartParserError, SuspiciousOperation) as exc:
        raise APIError(400, f"The request body is not a multipart/form-data form this server "
                            f"can read: {exc}", code="invalid_request") from exc


def check_form(fields: Mapping[str, list[str]], files: Any) -> Upload:
    """The checked form of an upload.

    Raises:
        APIError: 400 naming the field: an unknown field or file part, one given twice, a
            missing one (``missing_required_parameter``), a file part sent as a text field, an
            invalid ``name``; ``adapter_model`` not named ``*.safetensors`` or not starting
            with a safetensors header, ``adapter_config`` not a JSON object (``invalid_file``).
    """
    names = [*(name for name, values in fields.items() for _ in values),
             *(name for name in files for _ in files.getlist(name))]
    for name in names:
        if name not in (*FIELDS, *FILES):
            raise invalid(_shown(name), f"Unknown parameter: '{_shown(name)}'. An upload takes "
                                        f"'name', 'model', 'adapter_config' and "
                                        f"'adapter_model'.", code="unknown_parameter")
        if names.count(name) > 1:
            raise invalid(name, f"'{name}' is given more than once.")
    for name in FILES:
        if name in fields:
            raise invalid(name, f"'{name}' must be a file part (with a filename), not a text "
                                "field.")
    for name in (*FIELDS, *FILES):
        if name not in names:
            raise invalid(name, f"Missing required parameter: '{name}' (an upload is a "
                                f"multipart/form-data form with 'name', 'model', "
                                f"'adapter_config' and 'adapter_model').",
                          code="missing_required_parameter")
    name = fields[NAME][0]
    if not valid_adapter_name(name):
        raise invalid(NAME, f"Invalid value for 'name': '{_shown(name)}' is not an adapter "
                            "name (a letter or digit, then letters, digits, '.', '_' or '-'; "
                            f"{ADAPTER_NAME_MAX} characters at most).")
    upload = Upload(name, fields[MODEL][0], files[CONFIG], files[WEIGHTS])
    _check_weights(upload.weights)
    _check_config(upload.config)
    return upload


def _check_weights(file: UploadedFile) -> None:
    filename = file.name or ""
    if not filename.endswith(".safetensors"):
        raise invalid(WEIGHTS, f"Invalid file: '{_shown(filename)}' is not a .safetensors file; "
                               f"an adapter's weights are {adapter_check.WEIGHTS_FILE} only "
                               "(never a pickle such as adapter_model.bin).",
                      code="invalid_file")
    try:
        adapter_check.read_header(file, file.size or 0)
    except ValueError as exc:
        raise invalid(WEIGHTS, f"Invalid file: {exc}", code="invalid_file") from exc


def _check_config(file: UploadedFile) -> None:
    if (file.size or 0) > adapter_check.MAX_CONFIG_BYTES:
        raise invalid(CONFIG, f"Invalid file: {adapter_check.CONFIG_FILE} is over "
                              f"{adapter_check.MAX_CONFIG_BYTES} bytes.", code="invalid_file")
    file.seek(0)
    try:
        config = json.loads(file.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise invalid(CONFIG, f"Invalid file: {adapter_check.CONFIG_FILE} is not valid JSON.",
                      code="invalid_file") from exc
    if not isinstance(config, dict):
        raise invalid(CONFIG, f"Invalid file: {adapter_check.CONFIG_FILE} is not a JSON "
                              "object.", code="invalid_file")


def taken(name: str) -> APIError:
    """409: the tenant has an adapter of that name over that base model, or a shared one is
    (another tenant's adapters never are: names are per tenant)."""
    return APIError(409, f"An adapter named '{name}' exists already over this base model; "
                         "choose another name or delete it first.", param=NAME,
                    code="adapter_exists")


def store(upload: Upload, key: ApiKey) -> LoraAdapter:
    """Create ``key``'s tenant's adapter of ``upload``: its row ``pending`` and its files
    written, then its check queued once the row is committed.

    Raises:
        APIError: 404 ``model_not_found`` for a base model the key may not call or that is not
            served (:func:`gateway.model_registry.model_not_found`); 409 :func:`taken`.
        OSError: its files could not be written (nothing is kept).
    """
    base = find(read_served_models(), Access.of_key(key), upload.base).name
    mine_or_shared = Q(owner_id=key.tenant_id) | Q(owner__isnull=True)
    if LoraAdapter.objects.filter(mine_or_shared, base_model=base, name=upload.name).exists():
        raise taken(upload.name)
    # A folder of its own, made new: never one that exists, which another row may name.
    folder = adapters.new_upload_folder(key.tenant.slug, base, upload.name)
    try:
        with transaction.atomic():
            row = LoraAdapter.objects.create(name=upload.name, base_model=base,
                                             owner_id=key.tenant_id, folder=str(folder))
            _write(folder, upload)
            adapters.queue_validation(row.pk)
    except IntegrityError as exc:  # taken meanwhile, before anything was written
        adapters.remove_folder(folder)
        raise taken(upload.name) from exc
    except BaseException:
        adapters.remove_folder(folder)  # this upload's own: no row names it
        raise
    return row


def _write(folder: Path, upload: Upload) -> None:
    adapters.write_private_file(folder, adapter_check.CONFIG_FILE, upload.config.chunks())
    adapters.write_private_file(folder, adapter_check.WEIGHTS_FILE, upload.weights.chunks())
