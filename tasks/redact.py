"""Connection URLs fit to show: the password masked wherever a URL is printed or logged.

One function for every URL Stepline shows (Redis, Sentinel lists, the artifact store).
"""

from __future__ import annotations

import re

MASK = "***"

# userinfo: everything between "scheme://" and the last "@" before the host's path; a password
# may itself hold "@", ":" or "/" characters, so the host part is found from the right.
_USERINFO = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:@;/]*):(?P<secret>[^;]*)@")
_SECRET_QUERY = re.compile(
    r"(?P<key>[?&;](?:password|sentinel_password|secret|secret_key|key|token)=)[^&;#]*",
    re.IGNORECASE)


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***``: in the userinfo of each URL of a
    ``;``-separated list (kombu's Sentinel form) and in ``password=``-like query fields.
    The user name, host, port, path and other fields stay, so the line still says where."""
    parts = [_mask_one(part) for part in url.split(";")]
    return ";".join(parts)


def _mask_one(url: str) -> str:
    masked = _USERINFO.sub(_mask_userinfo, url, count=1)
    return _SECRET_QUERY.sub(lambda m: m.group("key") + MASK, masked)


def _mask_userinfo(match: re.Match[str]) -> str:
    secret = match.group("secret")
    # the host follows the last "@": a secret containing "@" is masked whole
    return f"{match.group('scheme')}{match.group('user')}:{MASK if secret else ''}@"
