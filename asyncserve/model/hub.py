"""Hugging Face Hub ids (`Qwen/Qwen2.5-0.5B-Instruct`, an adapter's `org/name`) as local folders, as
vLLM takes them: through huggingface_hub's cache (HF_HOME, HF_HUB_CACHE), offline with
HF_HUB_OFFLINE=1, downloading what is missing when online (with its progress bars). A local file
or folder of that name wins where it exists. Only what serving reads is fetched: configs,
safetensors, tokenizer files, chat templates; never pickles or other formats beside them. A
repository of GGUF files is taken as llama.cpp's `-hf` takes it: `org/name:Q8_0` is its one file of
that quantization, plain `org/name` its Q4_K_M one; only that file is fetched.
"""
from __future__ import annotations

import re
from pathlib import Path

from asyncserve.model.config import ModelLoadError

# owner/name, as the Hub spells repository ids
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# owner/name:QUANT, one GGUF file of a repository (llama.cpp's -hf spelling)
_GGUF_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+):(?P<quant>\w[\w.-]*)$")
DEFAULT_GGUF_QUANT = "Q4_K_M"         # llama.cpp's, for a repository of GGUF files named without one
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.tiktoken"]
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def is_repo_id(path: str) -> bool:
    return bool(_REPO_ID.match(path)) and not path.endswith((".gguf", ".json", ".safetensors"))


def is_remote(path: str | None) -> bool:
    """Whether ``path`` names a Hub repository (or one GGUF file of it) rather than something on disk (a
    local one wins)."""
    return (path is not None and not Path(path).expanduser().exists()
            and (is_repo_id(path) or _GGUF_REF.match(path) is not None))


def resolve(path: str, revision: str | None = None, files: list[str] = MODEL_FILES, what: str = "model") -> str:
    """``path`` itself where it exists on disk or is no Hub id; else the Hub repository's snapshot folder
    at ``revision`` (a branch, tag or commit; default main), from the cache or downloaded; for a
    repository of GGUF files (org/name:QUANT, or org/name without a config.json) its file's path."""
    if not is_remote(path):
        return path
    if (ref := _GGUF_REF.match(path)) is not None:
        return _gguf_file(ref["repo"], ref["quant"], revision, what)
    folder = _snapshot(path, revision, files, what)
    if files is MODEL_FILES and not (Path(folder) / "config.json").is_file():    # a repository of GGUF files
        return _gguf_file(path, DEFAULT_GGUF_QUANT, revision, what)
    return folder


def _gguf_file(repo: str, quant: str, revision: str | None, what: str) -> str:
    """The repository's GGUF file of that quantization, fetched alone: the one whose name ends with it
    (any case, after a separator: Q6_K is not Q6_K_L nor IQ6_K), not a vision projector's mmproj file."""
    patterns = sorted({f"*{q}.gguf" for q in (quant, quant.upper(), quant.lower())})
    folder = Path(_snapshot(repo, revision, patterns, what))
    ending = re.compile(rf"(^|[^a-z0-9]){re.escape(quant.lower())}\.gguf$")
    found = sorted(p for p in folder.rglob("*.gguf")
                   if ending.search(p.name.lower()) and not p.name.lower().startswith("mmproj"))
    if not found:
        raise ModelLoadError(f"{what} {repo!r} has no GGUF file of quantization {quant!r} (named like *-{quant}.gguf; "
                             f"a model split in -00001-of-000NN parts is not read); name another as {repo}:Q8_0")
    if len(found) > 1:
        raise ModelLoadError(f"{what} {repo!r}: {', '.join(p.name for p in found)} are all of quantization "
                             f"{quant!r}; serve one of them by its path")
    return str(found[0])


def _snapshot(path: str, revision: str | None, files: list[str], what: str) -> str:
    """snapshot_download of the files, its errors as ModelLoadErrors that say what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(path, revision=revision, allow_patterns=files)
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set and it is not in the cache" if constants.HF_HUB_OFFLINE
               else "it is not in the cache and the Hub cannot be reached")
        raise ModelLoadError(f"{what} {path!r}{at} is neither a local file or folder nor in the Hugging Face "
                             f"cache ({constants.HF_HUB_CACHE}): {why}") from None
    except GatedRepoError:
        raise ModelLoadError(f"{what} {path!r} is gated on the Hugging Face Hub: accept its terms and log in "
                             "(`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{what} {path!r} is neither a local file or folder nor a repository on the Hugging "
                             "Face Hub (a private one needs `hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{what} {path!r} has no revision {revision!r} on the Hugging Face Hub") from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelLoadError(f"cannot download {what} {path!r}{at} from the Hugging Face Hub: {e}") from None
