"""Hugging Face Hub ids (`Qwen/Qwen2.5-0.5B-Instruct`, an adapter's `org/name`) as local folders, as
vLLM takes them: through huggingface_hub's cache (HF_HOME, HF_HUB_CACHE), offline with
HF_HUB_OFFLINE=1, downloading what is missing when online (with its progress bars). A local file
or folder of that name wins where it exists. Only what serving reads is fetched: configs,
safetensors, tokenizer files, chat templates; never pickles, GGUFs or other formats beside them.
"""
from __future__ import annotations

import re
from pathlib import Path

from asyncserve.model.config import ModelLoadError

# owner/name, as the Hub spells repository ids
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.tiktoken"]
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def is_repo_id(path: str) -> bool:
    return bool(_REPO_ID.match(path)) and not path.endswith((".gguf", ".json", ".safetensors"))


def is_remote(path: str | None) -> bool:
    """Whether ``path`` names a Hub repository rather than something on disk (a local one wins)."""
    return path is not None and not Path(path).expanduser().exists() and is_repo_id(path)


def resolve(path: str, revision: str | None = None, files: list[str] = MODEL_FILES, what: str = "model") -> str:
    """``path`` itself where it exists on disk or is no Hub id; else the Hub repository's snapshot folder
    at ``revision`` (a branch, tag or commit; default main), from the cache or downloaded."""
    if not is_remote(path):
        return path
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
