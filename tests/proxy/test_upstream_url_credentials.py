"""An upstream URL with a user name or password (`http://user:pass@host:8100`) is refused
when the config is validated: the proxy logs its upstreams (`proxy_started`,
`upstream_replica_failed`) and shows them in /admin/status, so the password went with them.
The upstream's key belongs in `proxy.upstream_api_key`."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from deploy.config import ConfigError, load_config
from proxy.config import ProxyConfig

PASSWORD = "s3cr3t-Pa55"


@pytest.mark.parametrize(
    "url",
    [
        f"http://user:{PASSWORD}@vllm-0:8100",
        f"https://user:{PASSWORD}@vllm-0.internal:8100/",
        f"http://:{PASSWORD}@10.0.0.5:8100",
        f"http://{PASSWORD}@vllm-0:8100",  # a token as the user name
        f"http://user:{PASSWORD}@[::1]:8100",
        f"http://user:{PASSWORD.replace('-', '%2D')}@vllm-0:8100",
        f"http://user:pa/{PASSWORD}@vllm-0:8100",  # an unescaped '/' in the password
        f"http://user:pa@{PASSWORD}@vllm-0:8100",  # an unescaped '@' in the password
        f"http://user:{PASSWORD}@vllm-0:8100/v1",
    ],
)
def test_an_upstream_url_with_credentials_is_refused_without_echoing_them(url: str) -> None:
    with pytest.raises(ValidationError) as info:
        ProxyConfig(upstreams=["http://vllm-1:8100", url])
    # What `olp` shows of it (pydantic's own str() also echoes the input; deploy.config
    # never shows a list's input, test_the_deploy_config_names_the_key).
    (error,) = info.value.errors()
    message = error["msg"]
    assert "upstreams" in message and "upstream_api_key" in message
    assert PASSWORD not in message and PASSWORD.replace("-", "%2D") not in message
    assert "vllm-0" in message or "10.0.0.5" in message or "::1" in message  # which one


def test_plain_upstream_urls_still_validate() -> None:
    config = ProxyConfig(
        upstreams=["http://vllm-0:8100/", "https://10.0.0.5:8100", "http://[::1]:8100"]
    )
    assert config.upstreams == ["http://vllm-0:8100", "https://10.0.0.5:8100", "http://[::1]:8100"]


def test_the_deploy_config_names_the_key(tmp_path: Path) -> None:
    """`olp` reports a bad value by its dotted key (deploy.config._format_error)."""
    config = tmp_path / "olp.yaml"
    config.write_text(f"proxy:\n  upstreams: ['http://u:{PASSWORD}@vllm-0:8100']\n")
    with pytest.raises(ConfigError) as info:
        load_config(config, environ={})
    message = str(info.value)
    assert "proxy.upstreams" in message and "proxy.upstream_api_key" in message
    assert PASSWORD not in message
