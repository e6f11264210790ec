"""Hugging Face Hub as a model source, through huggingface_hub itself.

Resolving asks the Hub's API (`HfApi.model_info(files_metadata=True)`: the commit, every file
with its size and LFS sha256), chooses the .gguf (by quantization, daemon/models/spec.py), and
checks access to that very file with `get_hf_file_metadata` (the HEAD of its resolve URL: a
gated repository answers 401/403 there even where its model info is public; the X-Linked-Size
and X-Linked-Etag headers confirm the size and sha256). The URL is pinned to the commit, so
the bytes a resumed download continues are the same bytes.

Downloading continues Stoker's partial file from what is already there (an HTTP Range request)
with huggingface_hub's headers (token, user agent), through Stoker's one downloader
(daemon/core/download.py: huggingface_hub's own `http_get` costs about nine times its CPU per
byte, and was most of a pull's time). Not `hf_hub_download`: the installed huggingface_hub (2.4)
writes each download to a process-unique temporary file and deletes it on any failure (its PR
#4228), so a download killed with the process starts from zero again; a 15 GB model must not.

HF_ENDPOINT and HF_TOKEN: the CLI passes its own (the daemon may have been started with
another environment); without them huggingface_hub's defaults apply (the daemon's HF_ENDPOINT
and HF_TOKEN, or the token file `hf auth login` writes). The token is never stored.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HFValidationError,
    HTTPError,  # the base of huggingface_hub's transport's errors, as huggingface_hub exports it
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers

from stoker.daemon.core.download import UrlReading
from stoker.daemon.core.download_records import DownloadError
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.part_sink import PartWriter
from stoker.daemon.models.spec import HubOptions, PullSpec, choose_file
from stoker.states.reasons import ReasonCode

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@attrs.frozen
class HubFile:
    """One resolved file: pinned to a commit, with the Hub's size and sha256."""

    repo: str
    commit: str
    filename: str
    url: str
    size: int
    sha256: str | None
    quant: str | None
    defaulted: bool
    available: tuple[str, ...]
    gated: Any = None

    @property
    def origin(self) -> str:
        return f"{self.repo}@{self.commit[:12]}/{self.filename}"


def classify(err: BaseException, *, spec: str, endpoint: str | None, token_given: bool) -> StokerError:
    """A huggingface_hub or network failure as a reason-coded StokerError, in this failure's words."""
    where = endpoint or "https://huggingface.co"
    said = _first_line(err)
    if isinstance(err, DownloadError):  # the body's first words say more than the download's sentence
        status, said = err.evidence.get("status"), err.evidence.get("body") or said
    else:
        status = getattr(getattr(err, "response", None), "status_code", None)
    evidence: dict[str, Any] = {"spec": spec, "endpoint": where, "status": status, "error": f"{type(err).__name__}"}
    hint = "the token in HF_TOKEN was refused" if token_given else "no token was sent: set HF_TOKEN"
    if isinstance(err, HFValidationError):
        return StokerError(
            ReasonCode.PULL_BAD_SPEC, f"{spec} is not a Hub repository name: {_first_line(err)}", evidence
        )
    if isinstance(err, GatedRepoError) or status in (401, 403) and not isinstance(err, RepositoryNotFoundError):
        return StokerError(
            ReasonCode.PULL_UNAUTHORIZED,
            f"{spec} is gated or private and the Hub refused access (HTTP {status}; {hint}). Accept the model's "
            "terms on its Hub page, then set HF_TOKEN to a read token and pull again.",
            evidence,
        )
    if isinstance(err, (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)):
        private = "" if token_given else " If it is private, set HF_TOKEN."
        return StokerError(
            ReasonCode.PULL_NOT_FOUND, f"The Hub at {where} has no {spec} (HTTP {status}).{private}", evidence
        )
    if isinstance(err, (OfflineModeIsEnabled, ConnectionError)) or (
        isinstance(err, (HTTPError, DownloadError)) and (status is None or status >= 500 or status in (408, 429))
    ):
        return StokerError(
            ReasonCode.PULL_SOURCE_UNREACHABLE,
            f"The Hub at {where} could not be reached or failed ({status or type(err).__name__}: {_first_line(err)}); "
            "retry when it answers (set HF_ENDPOINT for a mirror).",
            evidence,
        )
    if isinstance(err, (HTTPError, DownloadError)):
        return StokerError(ReasonCode.PULL_FAILED, f"The Hub answered HTTP {status} for {spec}: {said}", evidence)
    raise err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def resolve(spec: PullSpec, options: HubOptions) -> HubFile:
    """Which file `spec` names, at which commit, with the Hub's size and sha256 (blocking)."""
    assert spec.repo is not None
    token_given = bool(options.token)
    try:
        api = HfApi(endpoint=options.endpoint, token=options.token)
        info = api.model_info(spec.repo, files_metadata=True)
        siblings = {s.rfilename: s for s in info.siblings or ()}
        if spec.filename is not None:
            if spec.filename not in siblings:
                raise StokerError(
                    ReasonCode.PULL_NOT_FOUND,
                    f"{spec.repo} has no file {spec.filename}.",
                    {"spec": spec.text, "files": sorted(f for f in siblings if f.endswith(".gguf"))[:50]},
                )
            filename, quant, defaulted, available = spec.filename, None, False, tuple[str, ...]()
        else:
            choice = choose_file(siblings, spec.quant)
            filename, quant, defaulted, available = choice.filename, choice.quant, choice.defaulted, choice.available
        commit = info.sha
        if not commit:
            raise StokerError(ReasonCode.PULL_FAILED, f"The Hub named no commit for {spec.repo}.", {"spec": spec.text})
        sibling = siblings[filename]
        url = hf_hub_url(spec.repo, filename, revision=commit, endpoint=options.endpoint)
        head = get_hf_file_metadata(url, token=options.token, endpoint=options.endpoint)
    except StokerError:
        raise
    except Exception as err:
        raise classify(err, spec=spec.text, endpoint=options.endpoint, token_given=token_given) from None
    lfs_sha = sibling.lfs.sha256 if sibling.lfs is not None else None
    linked = head.etag if head.etag and _SHA256.match(head.etag) else None
    size = head.size if head.size is not None else (sibling.lfs.size if sibling.lfs is not None else sibling.size)
    if size is None:
        raise StokerError(ReasonCode.PULL_FAILED, f"The Hub states no size for {filename}.", {"spec": spec.text})
    return HubFile(
        repo=spec.repo,
        commit=commit,
        filename=filename,
        url=url,
        size=int(size),
        sha256=lfs_sha or linked,
        quant=quant,
        defaulted=defaulted,
        available=available,
        gated=info.gated,
    )


def download(url: str, writer: PartWriter, *, options: HubOptions) -> None:
    """Continue the file at `url` into `writer` from where it stands, with huggingface_hub's
    headers (token, user agent); the URL is pinned to a commit (blocking)."""
    headers = build_hf_headers(token=options.token)
    timeout = float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
    try:
        UrlReading(url, headers, ReasonCode.PULL_FAILED, timeout, pinned=True).run(writer)
    except DownloadError as err:
        raise classify(err, spec=url, endpoint=options.endpoint, token_given=bool(options.token)) from None
