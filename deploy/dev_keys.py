"""The development keys the default configuration ships with, published in olp's docs.

They let `./olpw up` work with no edits on loopback. A proxy that listens beyond this machine
with one of them is open to anyone who has read the README: the admin key turns training on
for any tenant, rolls back, freezes; the tenant key spends the model server's time."""

from __future__ import annotations

from deploy.config import OlpConfig
from deploy.ports import is_loopback
from proxy.config import sha256_hex

DEV_API_KEY = "olp-demo-key"
DEV_ADMIN_KEY = "olp-admin-dev"


def exposed_dev_keys(cfg: OlpConfig) -> str | None:
    """Why the proxy may not start on `cfg`: a development key on a bind that is not
    loopback; None when it may."""
    if is_loopback(cfg.proxy.host):
        return None
    found = []
    if cfg.proxy.admin_key_sha256 == sha256_hex(DEV_ADMIN_KEY):
        found.append(f"the admin key is the development one ({DEV_ADMIN_KEY})")
    found.extend(
        f"tenant {tenant.name!r} has the development key ({DEV_API_KEY})"
        for tenant in cfg.tenants
        if tenant.api_key_sha256 == sha256_hex(DEV_API_KEY)
    )
    if not found:
        return None
    return (
        f"the proxy would listen on {cfg.proxy.host} (proxy.host), beyond this machine, but "
        f"{' and '.join(found)}, which olp's docs publish: set your own keys (`olp key hash`; "
        "proxy.admin_key_sha256, tenants[].api_key_sha256) or listen on 127.0.0.1"
    )
