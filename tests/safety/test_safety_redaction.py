"""Redaction: every kind is caught, ordinary code and prose are left alone."""

from __future__ import annotations

import ast
import dataclasses
import json
import time

import msgspec
import pytest

from safety.config import BUILTIN_REDACTION_KINDS, CustomPattern, RedactionConfig
from safety.redaction import Redactor, merge_counts
from safety.redaction_kinds import luhn_ok

JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
    "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
)
PEM = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\n"
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
    "-----END OPENSSH PRIVATE KEY-----"
)

NPM_TOKEN = "npm_" + "Xq7Lm2Pz9R" * 3 + "t4Vb8N"  # 36 base62 characters
PYPI_TOKEN = "pypi-AgEIcHlwaS5vcmc" + "CJDRjMmE4YjE2LTk5ZDQtNGQ0OS1hMmUwLTdiNjM1N2E2Zjdk" * 2
DOCKER_PAT = "dckr_pat_" + "Zk3_Qm8vTn2-Lp5Rx9Wc4Hb7Ys1"  # 27 characters
AZURE_SECRET = "xYz8Q~" + "AbCdEfGh.IjKlMnOp_QrStUvWx~Yz012345"[:34]

CASES: list[tuple[str, str, str]] = [
    ("email", "write to jane.doe+olp@example.co.uk today", "jane.doe+olp@example.co.uk"),
    ("email", "write to josé.garcía@empresa.es today", "josé.garcía"),
    ("phone", "call +1 415 555 0100 now", "+1 415 555 0100"),
    ("phone", "office (415) 555-0100.", "(415) 555-0100"),
    ("phone", "cell 415-555-0199 please", "415-555-0199"),
    ("phone", "London +44 20 7946 0958", "+44 20 7946 0958"),
    ("credit_card", "card 4111 1111 1111 1111 exp 12/30", "4111 1111 1111 1111"),
    ("credit_card", "amex 378282246310005", "378282246310005"),
    ("credit_card", "mc 5555-5555-5555-4444", "5555-5555-5555-4444"),
    ("openai_key", "OPENAI_API_KEY=sk-proj-Abc123def456GHI789jkl012MNO345", "sk-proj-Abc123def456"),
    ("openai_key", "key sk-abcdefghijklmnopqrstuvwxyzABCD1234", "sk-abcdefghijklmnop"),
    ("anthropic_key", "sk-ant-api03-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789-xyz", "sk-ant-api03"),
    ("aws_access_key", "aws_access_key_id = AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE"),
    ("github_token", "token ghp_" + "A1b2C3d4E5" * 4, "ghp_A1b2C3d4E5"),
    ("github_token", "gho_" + "z" * 36 + " used", "gho_zzzz"),
    ("github_token", "github_pat_11ABCDEFG0" + "x" * 60, "github_pat_11ABCDEFG0"),
    ("slack_token", "SLACK=xoxb-1234567890-0987654321-AbCdEfGhIjKl", "xoxb-1234567890"),
    ("slack_token", "SLACK_APP_TOKEN=xapp-1-A0123456789-1234567890123-abcdef0123", "xapp-1-A01"),
    (
        "slack_token",
        "curl -X POST https://hooks.slack.com/services/T0001ABCD/B0002EFGH/XyZ123abcDEF456ghi",
        "T0001ABCD/B0002EFGH/XyZ123abcDEF",
    ),
    ("gitlab_token", "GITLAB_TOKEN=glpat-xYz12AbC34dEf56GhI78jK", "glpat-xYz12AbC34"),
    ("gitlab_token", "deploy token gldt-AbCdEfGhIjKlMnOpQrSt12", "gldt-AbCdEfGhIj"),
    ("google_api_key", "maps key AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", "AIzaSyA1b2C3d4"),
    ("jwt", f"session={JWT};", JWT[:40]),
    ("bearer_token", "Authorization: Bearer abc123DEF456ghi789.jkl", "abc123DEF456ghi789"),
    ("private_key", f"here is my key\n{PEM}\nthanks", "b3BlbnNzaC1rZXkt"),
    # Cut off by max_tokens: no END line.
    ("private_key", PEM.rsplit("\n", 1)[0][:-9], "b3BlbnNzaC1rZXkt"),
    # ...with the headers and the empty line of an encrypted PEM key, or a PGP key's.
    (
        "private_key",
        "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,3F17F5"
        "\n\nMIIEowIBAAKCAQEAxS3dpHrE5pFkVPaY9d1ZoE0F\nq2vR7kL9sPz0XcY3nM5tB8wQ1aJ4eH6gU2iO7",
        "MIIEowIBAAKCAQEA",
    ),
    (
        "private_key",
        "-----BEGIN PGP PRIVATE KEY BLOCK-----\nComment: exported\n\nlQOYBGNpZ2EBCADRwq8a3m1p"
        "V0Zk9Xy7Tt2Lq4Bn5Cc6\nKk4Ll5Mm6Nn7Oo8Pp9\n",
        "lQOYBGNpZ2EB",
    ),
    (
        "sendgrid_key",
        "SENDGRID_API_KEY=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",
        "ngeVfQFYQlKU0ufo8x5d1A",
    ),
    ("email", "GET /users?email=jane.doe%40example.com&page=2", "jane.doe"),
    ("stripe_key", "STRIPE_KEY=sk_live_51H8xAbCdEfGhIjKlMnOp", "sk_live_51H8x"),
    ("huggingface_token", "HF_TOKEN=hf_" + "AbCdEfGhIj" * 3 + "Klmn", "hf_AbCdEfGhIj"),
    ("bearer_token", "Authorization: BEARER abcdefghijklmnop1234", "abcdefghijklmnop"),
    ("basic_auth", "Authorization: Basic dXNlcjpzM2NyZXRQYXNzd29yZA==", "dXNlcjpzM2NyZXRQ"),
    ("url_password", "postgres://admin:s3cretP4ss@10.0.0.5:5432/app", "s3cretP4ss"),
    ("url_password", "redis://default:s3cretP4ss@localhost:6379/0", "s3cretP4ss"),
    # Unescaped `@`, `#`, `?`, `/` in a pasted DSN's password.
    ("url_password", "https://user:p@ss#w?rd@host/path", "ss#w?rd"),
    ("url_password", "postgres://u:a/b@db:5432/x", ":a/b@"),
    # Credentials in a query, a presigned URL, a connection string.
    ("url_password", "jdbc:sqlserver://db;user=sa;Password=Str0ng!Pass;", "Str0ng!Pass"),
    (
        "url_password",
        "https://acct.blob.core.windows.net/c/b.txt?sv=2022-11-02&sp=r&sig=AbCd%2Bef%3D",
        "AbCd%2Bef",
    ),
    (
        "url_password",
        "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature="
        "4f1c0a9b2e7d8c6a5b4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b",
        "4f1c0a9b2e7d",
    ),
    (
        "url_password",
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEt"
        "lCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==;EndpointSuffix=core.wi"
        "ndows.net",
        "Eby8vdM02x",
    ),
    # Temporary AWS credentials: the session token goes too.
    (
        "aws_access_key",
        "AWS_SESSION_TOKEN=IQoJb3JpZ2luX2VjEAoaCXVzLWVhc3QtMSJHMEUCIQD" + "Ab1Cd2Ef3" * 9,
        "IQoJb3JpZ2lu",
    ),
    # Google OAuth access token and client secret.
    (
        "google_api_key",
        "gcloud token ya29.a0AfH6SMBx1234567890abcdefghijklmnopqrstuv",
        "a0AfH6SMBx",
    ),
    ("google_api_key", "GOOGLE_CLIENT_SECRET=GOCSPX-AbCdEfGhIjKlMnOpQrStUvWxYz12", "AbCdEfGhIjKl"),
    # An API-key header (Azure OpenAI's `api-key`, `X-API-Key`), curl's Basic credentials.
    ("bearer_token", "X-API-Key: 3f2504e04f8911d39a0c0305e82c3301", "3f2504e04f89"),
    ("bearer_token", '{"api-key": "b2c1f0e9d8c7b6a5f4e3d2c1b0a9f8e7"}', "b2c1f0e9d8c7"),
    ("bearer_token", "Authorization: Token 9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b", "9944b09"),
    ("basic_auth", "curl -s -u admin:s3cr3tPass https://api.example.com/v1", "s3cr3tPass"),
    # Package registries and Microsoft Entra ID (all made up, in the vendors' formats).
    ("npm_token", "//registry.npmjs.org/:_authToken=" + NPM_TOKEN, NPM_TOKEN[4:20]),
    ("pypi_token", "[pypi]\nusername = __token__\npassword = " + PYPI_TOKEN, PYPI_TOKEN[20:40]),
    ("docker_hub_token", "echo " + DOCKER_PAT + " | docker login -u bob", DOCKER_PAT[9:20]),
    ("azure_client_secret", "AZURE_CLIENT_SECRET=" + AZURE_SECRET, AZURE_SECRET[6:20]),
    # A secret assigned to a secret's name, in an env file, a shell, YAML, JSON.
    ("secret_assignment", "DB_PASSWORD=hunter2x", "hunter2x"),
    ("secret_assignment", 'export MYSQL_ROOT_PASSWORD="s3cr3t!"', "s3cr3t!"),
    ("secret_assignment", "  password: abc123def", "abc123def"),
    ("secret_assignment", '{"db_pass": "Tr0ub4dor&3"}', "Tr0ub4dor&3"),
    # A token's name with a random value, a .netrc entry, a MySQL client's `-p`, XML, a JSON
    # number, a plain word in YAML.
    ("secret_assignment", "token=3f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c", "3f9a8b7c6d5e"),
    ("secret_assignment", "machine api.example.com login bob password hunter", "hunter"),
    ("secret_assignment", "mysql -h db -u root -pS3cr3tPw app", "S3cr3tPw"),
    ("secret_assignment", "<password>Tr0ub4dor</password>", "Tr0ub4dor"),
    ("secret_assignment", '{"password": 12345678}', "12345678"),
    ("secret_assignment", "  password: postgres", "postgres"),
    # A URL password whose path holds an `@` after a host without a dot.
    ("url_password", "https://u:pw@localhost/npm/pkg@1.0", ":pw@"),
    # Unsigned (`alg: none`) and encrypted (five-part) JWTs.
    (
        "jwt",
        "id_token=eyJhbGciOiJub25lIn0.eyJzdWIiOiIxMjM0NTY3ODkwIn0.",
        "eyJzdWIiOiIxMjM0NTY3ODkw",
    ),
    (
        "jwt",
        "session=eyJhbGciOiJkaXIiLCJlbmMiOiJBMjU2R0NNIn0..kZ3vQ1x2Y3z4A5b6.AbCdEfGhIjKlMnOpQrSt"
        "UvWx.Zx9Yw8Vu7Ts6Rq5P",
        "AbCdEfGhIjKlMnOp",
    ),
]


@pytest.mark.parametrize(("kind", "text", "secret"), CASES)
def test_each_kind_is_redacted(kind: str, text: str, secret: str) -> None:
    redacted, counts = Redactor().redact_text(text)
    assert secret not in redacted
    assert f"[REDACTED:{kind}]" in redacted
    assert counts == {kind: 1}


def test_every_builtin_kind_has_a_case() -> None:
    assert {kind for kind, _, _ in CASES} == set(BUILTIN_REDACTION_KINDS)


CLEAN_SAMPLES = [
    "def add(a: int, b: int) -> int:\n    return a + b  # 17 + 25 = 42\n",
    "for i in range(1000000):\n    total += values[i] * 3.14159265358979\n",
    "ts = 1732912345678  # ms since epoch; id 9876543210123",
    "Commit 4b825dc642cb6eb9a060e54bf8d69288fbee4904 fixed issue #12345.",
    "Version 2.13.0+cpu, listen on 127.0.0.1:8100, see RFC 7231 section 6.5.1.",
    "uuid 3f2504e0-4f89-11d3-9a0c-0305e82c3301 and sha256 e3b0c44298fc1c149afbf4c8996fb924",
    "The token count was 1234 and max_tokens=16; a task-skeleton named sk-learn.",
    "@decorator\nclass Foo:\n    email_field = 'email'\n    phone = None\n",
    "Call me maybe. The answer is 42, or 3.5 million dollars in 2024-11-29.",
    "x = np.array([1, 2, 3]) + 10**12; y = -1234567.89",
    "Bearer tokens go in the Authorization header.",
    "Basic authentication sends a base64 username:password pair; see https://example.com:8443/x.",
    # Digit runs inside hex hashes and UUIDs that would pass the card check on their own.
    "commit 5d8f6cce532a7aeb57196be4111111111111111b3aeb3580d248b17d5518a86 ok",
    "id=852d2ee5-0061-4d4111111111111111cd43a and x = 0x4111111111111111",
    "uuid 20198123-5258-4042-b18b-51a7b40d56e0",
    "Slack webhooks live at hooks.slack.com/services; GitLab's glpat- prefix marks a token.",
]


@pytest.mark.parametrize("text", CLEAN_SAMPLES)
def test_no_false_positive_on_ordinary_code_and_text(text: str) -> None:
    assert Redactor().redact_text(text) == (text, {})


def test_luhn_rejects_near_miss_card_numbers() -> None:
    assert luhn_ok("4111111111111111")
    assert not luhn_ok("4111111111111112")
    text = "order 4111 1111 1111 1112 shipped"
    assert Redactor().redact_text(text) == (text, {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("card 4111 1111 1111 1111 123", "card [REDACTED:credit_card] 123"),
        ("card 4111111111111111 123", "card [REDACTED:credit_card] 123"),
        ("4111 1111 1111 1111 12/27 cvv 123", "[REDACTED:credit_card] 12/27 cvv 123"),
        ("4111-1111-1111-1111 123.", "[REDACTED:credit_card] 123."),
        ("4111111111111111 12 27", "[REDACTED:credit_card] 12 27"),
        ("amex 378282246310005 2027", "amex [REDACTED:credit_card] 2027"),
        ("cvv 123 4111 1111 1111 1111", "cvv 123 [REDACTED:credit_card]"),
        ("exp 12/27 4111 1111 1111 1111", "exp 12/27 [REDACTED:credit_card]"),
    ],
)
def test_a_card_number_next_to_a_cvv_or_expiry_is_redacted(text: str, expected: str) -> None:
    # The pattern takes up to 19 digits, so a short number after (or before) a card number
    # joined its run; the longer number failed Luhn and the card number went out as it was.
    assert Redactor().redact_text(text) == (expected, {"credit_card": 1})
    assert Redactor().redact_obj({"payment": text}) == ({"payment": expected}, {"credit_card": 1})


@pytest.mark.parametrize(
    "text",
    [
        "order 4111 1111 1111 1112 123",  # a near miss stays one with a CVV after it
        "1 2 3 4 5 6 7 8 9 10 11 12 13 14",  # no part of a list of small numbers is tried
        "0 1 1 2 3 5 8 13 21 34 55 89 144",
        "2024 10 11 12 13 14 15 16",
    ],
)
def test_digit_runs_with_no_card_number_in_them_stay(text: str) -> None:
    assert Redactor().redact_text(text) == (text, {})


def test_redact_obj_walks_messages_tool_calls_and_metadata_without_mutating() -> None:
    body = {
        "model": "policy",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "mail bob@example.com"}]},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "send",
                            "arguments": json.dumps({"to": "alice@example.org", "n": 2}),
                        },
                    }
                ],
            },
        ],
        "metadata": {"note": "card 4111111111111111", "tags": ["x", "+1 415 555 0100"]},
        "max_tokens": 16,
        "temperature": 0.0,
        "stream": False,
    }
    original = json.loads(json.dumps(body))
    redacted, counts = Redactor().redact_obj(body)
    assert body == original
    assert counts == {"email": 2, "credit_card": 1, "phone": 1}
    assert redacted["messages"][1]["content"][0]["text"] == "mail [REDACTED:email]"
    arguments = json.loads(redacted["messages"][2]["tool_calls"][0]["function"]["arguments"])
    assert arguments == {"to": "[REDACTED:email]", "n": 2}
    assert redacted["metadata"]["tags"] == ["x", "[REDACTED:phone]"]
    assert redacted["max_tokens"] == 16 and redacted["stream"] is False


def test_only_the_secret_part_of_a_url_or_header_is_replaced() -> None:
    redactor = Redactor()
    assert redactor.redact_text("db at postgres://admin:hunter2pw@db.internal:5432/app") == (
        "db at postgres://admin:[REDACTED:url_password]@db.internal:5432/app",
        {"url_password": 1},
    )
    assert redactor.redact_text('{"authorization": "Basic dXNlcjpwYXNzd29yZA=="}') == (
        '{"authorization": "Basic [REDACTED:basic_auth]"}',
        {"basic_auth": 1},
    )


def test_basic_credentials_in_nested_json_with_escaped_quotes_are_redacted() -> None:
    # A tool's string argument holding JSON holding headers: inside it the quotes are
    # escaped, and the name-then-`Basic` pattern used to stop at the backslash.
    redactor = Redactor()
    inner = json.dumps({"headers": {"authorization": "Basic dXNlcjpwYXNz"}})
    assert redactor.redact_text(json.dumps(inner)) == (
        json.dumps(inner).replace("dXNlcjpwYXNz", "[REDACTED:basic_auth]"),
        {"basic_auth": 1},
    )
    call = {"arguments": json.dumps({"request": inner})}
    redacted, counts = redactor.redact_obj(call)
    assert counts == {"basic_auth": 1}
    assert "dXNlcjpwYXNz" not in json.dumps(redacted)
    assert json.loads(json.loads(redacted["arguments"])["request"]) == {
        "headers": {"authorization": "Basic [REDACTED:basic_auth]"}
    }
    assert redactor.redact_text("'Authorization': \\'basic dXNlcjpwYXNzd29yZA==\\'") == (
        "'Authorization': \\'basic [REDACTED:basic_auth]\\'",
        {"basic_auth": 1},
    )


@pytest.mark.parametrize(
    "text",
    [
        'The \\"authorization\\" header with Basic credentials is sent on every request.',
        'docs say \\"authorization\\" \\"basic authentication\\" is weak',
        'log(\\"authorization\\\\: basic\\") and {\\"authorization\\": \\"Bearer\\"}',
    ],
)
def test_escaped_authorization_names_without_basic_credentials_stay(text: str) -> None:
    assert Redactor().redact_text(text) == (text, {})


def test_a_url_password_holding_an_at_sign_is_redacted_whole() -> None:
    # `P@ssw0rd` unescaped in a connection string: the userinfo ends at the last `@` of the
    # authority (as urllib reads it), so no tail of the password is left behind.
    redactor = Redactor()
    assert redactor.redact_text("DATABASE_URL=postgres://admin:P@ssw0rd@db:5432/app") == (
        "DATABASE_URL=postgres://admin:[REDACTED:url_password]@db:5432/app",
        {"url_password": 1},
    )
    assert redactor.redact_text('{"a":"redis://:p@ss@cache:6379/0","b":"x@y"}') == (
        '{"a":"redis://:[REDACTED:url_password]@cache:6379/0","b":"x@y"}',
        {"url_password": 1},
    )


AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[default]\naws_access_key_id = AKIAIOSFODNN7EXAMPLE\n"
            f"aws_secret_access_key = {AWS_SECRET}",
            "[default]\naws_access_key_id = [REDACTED:aws_access_key]\n"
            "aws_secret_access_key = [REDACTED:aws_access_key]",
        ),
        (
            f"export AWS_SECRET_ACCESS_KEY={AWS_SECRET}",
            "export AWS_SECRET_ACCESS_KEY=[REDACTED:aws_access_key]",
        ),
        (
            f'{{"AccessKeyId": "ASIAIOSFODNN7EXAMPLE", "SecretAccessKey": "{AWS_SECRET}"}}',
            '{"AccessKeyId": "[REDACTED:aws_access_key]", '
            '"SecretAccessKey": "[REDACTED:aws_access_key]"}',
        ),
        (
            f"boto3.client('s3', aws_secret_access_key='{AWS_SECRET}')",
            "boto3.client('s3', aws_secret_access_key='[REDACTED:aws_access_key]')",
        ),
        # The IAM console's credentials CSV: the secret right after its key id.
        (
            f"Access key ID,Secret access key\nAKIAIOSFODNN7EXAMPLE,{AWS_SECRET}\n",
            "Access key ID,Secret access key\n"
            "[REDACTED:aws_access_key],[REDACTED:aws_access_key]\n",
        ),
    ],
)
def test_aws_secret_access_keys_are_redacted_with_their_key_ids(text: str, expected: str) -> None:
    # The key id alone is not the credential: the 40-character secret next to it is.
    redacted, counts = Redactor().redact_text(text)
    assert AWS_SECRET not in redacted
    assert redacted == expected
    assert set(counts) == {"aws_access_key"}


def test_aws_secret_labels_without_a_secret_stay() -> None:
    text = 'secret = os.environ["AWS_SECRET_ACCESS_KEY"]  # AKIA ids are 20 chars'
    assert Redactor().redact_text(text) == (text, {})


def test_dict_keys_are_redacted_too() -> None:
    redacted, counts = Redactor().redact_obj({"allow": {"bob@example.com": True, "n": 1}})
    assert redacted == {"allow": {"[REDACTED:email]": True, "n": 1}}
    assert counts == {"email": 1}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("josé.garcía@empresa.es", "[REDACTED:email]"),
        ("bob@münchen.de", "[REDACTED:email]"),
        ("ana@exämple.com", "[REDACTED:email]"),
        ("write to müller@example.de", "write to [REDACTED:email]"),
        ("Ünal@firma.de, иван@пример.рф", "[REDACTED:email], [REDACTED:email]"),
        ("user@例え.jp", "[REDACTED:email]"),
        ("jose\u0301@example.com", "[REDACTED:email]"),  # `é` as `e` and a combining accent
        # Chinese and Japanese put no space around an address: their text stays.
        ("邮箱bob@example.com谢谢", "邮箱[REDACTED:email]谢谢"),
        ("メールはjosé@example.comです", "メールは[REDACTED:email]です"),
        ("bob@example.com으로 보내세요", "[REDACTED:email]으로 보내세요"),
    ],
)
def test_an_address_with_non_ascii_letters_is_redacted_whole(text: str, expected: str) -> None:
    # The local part and the domain were ASCII-only: `josé.garcía@empresa.es` lost only
    # `a@empresa.es`, and `bob@münchen.de` nothing.
    redactor = Redactor()
    count = expected.count("[REDACTED:email]")
    assert redactor.redact_text(text) == (expected, {"email": count})
    # The same in JSON text written with `ensure_ascii` (`jos\u00e9`) and in an object.
    assert redactor.redact_text(json.dumps(text)) == (json.dumps(expected), {"email": count})
    assert redactor.redact_obj({"user": {"email": text}}) == (
        {"user": {"email": expected}},
        {"email": count},
    )


def test_custom_patterns_and_disabled_kinds() -> None:
    config = RedactionConfig(
        kinds=["email"],
        custom_patterns=[CustomPattern(name="ticket", regex=r"\bACME-\d{4,}\b")],
    )
    redactor = Redactor.from_config(config)
    text = "ACME-12345 from a@b.io, card 4111111111111111"
    assert redactor.redact_text(text) == (
        "[REDACTED:ticket] from [REDACTED:email], card 4111111111111111",
        {"ticket": 1, "email": 1},
    )
    off = Redactor.from_config(RedactionConfig(enabled=False))
    assert off.redact_text(text) == (text, {})


def test_bad_config_is_rejected_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="invalid regular expression"):
        CustomPattern(name="bad", regex="(unclosed")
    with pytest.raises(ValueError, match="empty string"):
        CustomPattern(name="empty", regex="a*")
    with pytest.raises(ValueError, match="unknown redaction kinds"):
        RedactionConfig(kinds=["emails"])
    with pytest.raises(ValueError, match="not built-in"):
        RedactionConfig(custom_patterns=[CustomPattern(name="email", regex="x+")])


def test_merge_counts() -> None:
    assert merge_counts({"email": 1}, {"email": 2, "jwt": 1}, {}) == {"email": 3, "jwt": 1}


@pytest.mark.parametrize(
    ("text", "expected", "counts"),
    [
        # No userinfo: the `@` is in the query, so the e-mail rule takes it, not the URL one.
        (
            "http://localhost:8000?email=a@b.com",
            "http://localhost:8000?email=[REDACTED:email]",
            {"email": 1},
        ),
        (
            "GET https://api.example.com:443#user:x@example.org",
            "GET https://api.example.com:443#user:[REDACTED:email]",
            {"email": 1},
        ),
        ("see http://host:80/a:b@c for details", "see http://host:80/a:b@c for details", {}),
        # Userinfo and an `@` in the query: only the authority's password goes.
        (
            "https://user:p@ss@host/x?to=a@b.com",
            "https://user:[REDACTED:url_password]@host/x?to=[REDACTED:email]",
            {"url_password": 1, "email": 1},
        ),
        (
            "https://user:pw@host?to=a@b.com",
            "https://user:[REDACTED:url_password]@host?to=[REDACTED:email]",
            {"url_password": 1, "email": 1},
        ),
        # An IPv6 literal is a host, not `user:password`.
        (
            "http://[::1]:8000?email=a@b.com",
            "http://[::1]:8000?email=[REDACTED:email]",
            {"email": 1},
        ),
    ],
)
def test_an_at_sign_after_the_authority_is_not_a_url_password(
    text: str, expected: str, counts: dict[str, int]
) -> None:
    # Userinfo can only sit between `scheme://` and the first `/`, `?` or `#`.
    assert Redactor().redact_text(text) == (expected, counts)


@pytest.mark.parametrize(
    "name",
    [
        "sk-learn-model-selection-helpers",
        "sk-learn-preprocessing-pipeline-utils",
        "the sk-image-segmentation-tutorial-notebook repo",
        "module sk_helpers.sk-feature-extraction-helpers_v",
        "theme sk-ant-design-theme-customization-helpers",
    ],
)
def test_kebab_case_identifiers_starting_with_sk_are_not_api_keys(name: str) -> None:
    assert Redactor().redact_text(name) == (name, {})


_B62 = "T3BlbkFJ"  # every OpenAI key body carries upper-case letters or digits
OPENAI_KEYS = [
    "sk-" + "aB3dE5fG7hJ9kL1mN2pQ4rS6tU8vW0xY" + _B62 + "zA1bC2dE",  # legacy, 48 base62
    "sk-proj-" + "Ab1_cD2-eF3gH4iJ5kL6mN7oP8qR9sT0uV" + _B62 + "wX_yZ-aB1cD2eF3gH4",
    "sk-proj-" + "abcdefghij-klmnopqrst_uvwxyz0123" + _B62 + "abcdefghijklmnop",
    "sk-svcacct-" + "Zx9_Yw8-Vu7Ts6Rq5Po4Nm3Lk2" + _B62 + "Ji1Hg0Fe_Dc-Ba98",
    "sk-admin-" + "Qw3Er4Ty5Ui6Op7As8Df9" + _B62 + "Gh0Jk1Lz2Xc3-Vb4_Nm5",
    "sk-None-" + "aaaa1bbbb2cccc3dddd4" + _B62 + "eeee5ffff6",
    "sk-" + "0123456789abcdef0123456789abcdef01234567",  # lower-case and digits only
]


@pytest.mark.parametrize("key", OPENAI_KEYS)
def test_realistic_openai_key_shapes_are_redacted(key: str) -> None:
    redacted, counts = Redactor().redact_text(f'OPENAI_API_KEY="{key}"')
    assert redacted == 'OPENAI_API_KEY="[REDACTED:openai_key]"'
    assert counts == {"openai_key": 1}


def test_a_url_password_does_not_reach_into_the_next_json_string() -> None:
    # Tool-call arguments are JSON text: a URL with a port must not be read as
    # `user:password` running through the closing quote up to an e-mail's `@`.
    arguments = json.dumps({"url": "http://host:80", "to": "x@example.com"}, separators=(",", ":"))
    redacted, counts = Redactor().redact_text(arguments)
    assert json.loads(redacted) == {"url": "http://host:80", "to": "[REDACTED:email]"}
    assert counts == {"email": 1}


@pytest.mark.parametrize("password", ["P#ssw0rd!", "pa?ss", "s3cr#t?x"])
def test_an_unescaped_hash_or_question_mark_in_a_url_password_is_still_redacted(
    password: str,
) -> None:
    # Strictly the authority ends at `#` / `?`, but a pasted DSN with such a password is
    # still a secret. Only `host:<port>?` / `host:<port>#` (digits, then the query or the
    # fragment) marks where the authority ends.
    text = f"DATABASE_URL=postgres://admin:{password}@db:5432/app"
    assert Redactor().redact_text(text) == (
        "DATABASE_URL=postgres://admin:[REDACTED:url_password]@db:5432/app",
        {"url_password": 1},
    )


def test_custom_patterns_apply_to_short_strings() -> None:
    # Strings under 6 characters are skipped because no built-in kind matches that little;
    # an operator's pattern can (a 5-character employee id alone in a metadata value).
    config = RedactionConfig(custom_patterns=[CustomPattern(name="employee", regex=r"\bE\d{4}\b")])
    redactor = Redactor.from_config(config)
    assert redactor.redact_text("E1234") == ("[REDACTED:employee]", {"employee": 1})
    redacted, counts = redactor.redact_obj({"owner": "E1234", "n": 1})
    assert (redacted, counts) == ({"owner": "[REDACTED:employee]", "n": 1}, {"employee": 1})
    assert Redactor().redact_text("a@b.c") == ("a@b.c", {})


@pytest.mark.parametrize(
    "key",
    [
        "sk-ant-api03-" + "aB3_dE5-fG7hJ9kL1mN2pQ4rS6tU8vW0xYzA1bC2dE" * 2 + "AA",
        "sk-ant-admin01-" + "zyxwvutsrq0987654321_abcdefghij-klmnop" + "AA",
        "sk-ant-oat01-" + "Q" * 8 + "abcdefghijklmnopqrstuvwxyz",
    ],
)
def test_realistic_anthropic_key_shapes_are_redacted(key: str) -> None:
    assert Redactor().redact_text(f"ANTHROPIC_API_KEY={key}") == (
        "ANTHROPIC_API_KEY=[REDACTED:anthropic_key]",
        {"anthropic_key": 1},
    )


@pytest.mark.parametrize("escaped", ["\n", "\t", '"', "\\", "\x01"])
def test_redact_obj_finds_what_redact_text_finds_next_to_an_escaped_character(
    escaped: str,
) -> None:
    # `redact_obj` first searches the object's JSON text for the needles, where a newline is
    # `\n`: a needle anchored with `\b` missed `glpat-` at the start of a line (a `.env`
    # file in a message), and the whole object went out unredacted.
    redactor = Redactor()
    assert redactor.redact_obj({"c": f"env:{escaped}glpat-xYz12AbC34dEf56GhI78jK"}) == (
        {"c": f"env:{escaped}[REDACTED:gitlab_token]"},
        {"gitlab_token": 1},
    )
    for _, text, _ in CASES:
        for at in range(len(text) + 1):
            value = text[:at] + escaped + text[at:]
            expected, counts = redactor.redact_text(value)
            assert redactor.redact_obj({"c": value}) == ({"c": expected}, counts), value


@pytest.mark.parametrize("regex", [r"\b", r"(?=TICK)", r"\bTICK-\d*(?=x)|(?<=a)"])
def test_a_custom_pattern_that_matches_nothing_inserts_nothing(regex: str) -> None:
    """Such patterns pass the config check (they do not match the empty text) but used to
    put a marker at every position where they matched nothing."""
    redactor = Redactor(custom_patterns=[CustomPattern(name="ticket", regex=regex)])
    text = "see TICK-12 and a ticket"
    assert redactor.redact_text(text) == (text, {})
    assert redactor.redact_obj({"note": text}) == ({"note": text}, {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "https://user:p@ss#w?rd@host/path",
            "https://user:[REDACTED:url_password]@host/path",
        ),
        ("postgres://u:a/b@db:5432/x", "postgres://u:[REDACTED:url_password]@db:5432/x"),
        (
            "amqp://guest:gu/e?st#1@rabbit:5672/",
            "amqp://guest:[REDACTED:url_password]@rabbit:5672/",
        ),
        ("mysql://root:a@b?c#d@db/app", "mysql://root:[REDACTED:url_password]@db/app"),
        ("redis://:s3/cr@t@cache:6379/0", "redis://:[REDACTED:url_password]@cache:6379/0"),
        # An `@` and then a `/` in the password: `a@b/c` used to be cut at its first `@`.
        ("https://u:a@b/c@host/path", "https://u:[REDACTED:url_password]@host/path"),
        (
            "ftp://u:p@ss/w0rd@files.example.com/pub",
            "ftp://u:[REDACTED:url_password]@files.example.com/pub",
        ),
        (
            'DATABASE_URL="postgres://app:x/y?z@db.internal:5432/app?sslmode=require"',
            'DATABASE_URL="postgres://app:[REDACTED:url_password]@db.internal:5432/app'
            '?sslmode=require"',
        ),
    ],
)
def test_a_url_password_with_an_at_hash_question_mark_or_slash_is_redacted_whole(
    text: str, expected: str
) -> None:
    # Strictly the authority ends at the first `/`, `?` or `#`, so `p@ss#w?rd@host` read as
    # host `ss`: the password's tail after its first `@` (or everything after a `/`) leaked.
    assert Redactor().redact_text(text) == (expected, {"url_password": 1})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # An `@` in the path or query of a URL without a password stays (or is an e-mail).
        ("http://localhost:8000/p?email=a@b.com", "http://localhost:8000/p?email=[REDACTED:email]"),
        ("https://cdn.jsdelivr.net/npm/pkg@1.0/dist/x.js", None),
        ("https://medium.com/@author/a-post", None),
        ("docker pull registry:5000/img@sha256:0123abcd", None),
        ("http://{host}:{port}/users/{uid}@v2", None),
        ("http://host:port/path@v", None),
        ("http://${HOST}:${PORT}/a@b", None),
        # `user@host` without a password.
        ("ssh://deploy@buildhost:22/srv/app", None),
        ("http://user@host:8080/path@x", None),
        # With a password, the path's or query's `@` is not part of it.
        (
            "https://u:pw@registry.example.com/@babel/core",
            "https://u:[REDACTED:url_password]@registry.example.com/@babel/core",
        ),
        (
            "https://u:tok@host?to=a@b.com",
            "https://u:[REDACTED:url_password]@host?to=[REDACTED:email]",
        ),
        ("write to jane.doe@example.com", "write to [REDACTED:email]"),
        # A URL, then an address after a `,` or `;`: no `user:password` (it used to read
        # `x/y,a` as the password of host `b.co`).
        ("http://h:x/y,a@b.co", "http://h:x/y,[REDACTED:email]"),
        ("see http://h:x/y;bob@example.com", "see http://h:x/y;[REDACTED:email]"),
        # An `@` right after a `/`, or in the path after a host with a dot, is the path's.
        (
            "https://u:pw@registry/@babel/core",
            "https://u:[REDACTED:url_password]@registry/@babel/core",
        ),
        (
            "https://u:pw@cdn.example.com/npm/pkg@1.0/x.js",
            "https://u:[REDACTED:url_password]@cdn.example.com/npm/pkg@1.0/x.js",
        ),
    ],
)
def test_urls_and_addresses_around_url_passwords_are_not_mangled(
    text: str, expected: str | None
) -> None:
    assert Redactor().redact_text(text)[0] == (text if expected is None else expected)


@pytest.mark.parametrize(("kind", "text", "secret"), CASES)
def test_a_secret_in_json_text_held_in_a_string_is_redacted_and_the_json_stays_valid(
    kind: str, text: str, secret: str
) -> None:
    # A tool call's `arguments` (or a tool result) is JSON text inside a string: a line
    # break there is the two characters `\n`, a word character before the next line. `\b`
    # does not hold after it, so `\nAKIA...` / `\nsk-...` used to leave unredacted; and an
    # e-mail was cut from the `n`, leaving `\[REDACTED:email]`, which is not valid JSON.
    redactor = Redactor()
    value = f"first line\n{text}"
    arguments = json.dumps({"content": value})
    redacted, counts = redactor.redact_obj({"arguments": arguments})
    assert secret not in redacted["arguments"]
    assert json.loads(redacted["arguments"]) == {"content": redactor.redact_text(value)[0]}
    assert counts == {kind: 1}
    escaped_unicode = json.dumps({"content": f"\u00e9{text}"})  # `\u00e9` right before it
    assert secret not in redactor.redact_text(escaped_unicode)[0]


@pytest.mark.parametrize(
    "value",
    [
        {"username": "bob", "password": 12345678},
        {"card": 4111111111111111, "amount": 12},
        {"pin": 1234, "db_password": 98765432},
    ],
)
def test_a_number_redacted_in_json_text_leaves_valid_json(value: dict) -> None:
    """`{"password": 12345678}` became `{"password": [REDACTED:...]}`, which does not parse:
    a tool call's `arguments` were no longer JSON for every reader of the record."""
    redactor = Redactor()
    text = json.dumps(value)
    redacted, counts = redactor.redact_text(text)
    parsed = json.loads(redacted)
    assert counts and all(
        str(v).startswith("[REDACTED:")
        for k, v in parsed.items()
        if k != "amount" and k != "username" and k != "pin"
    )
    nested = json.dumps({"arguments": text})  # JSON text inside a JSON string
    redacted_nested, _ = redactor.redact_text(nested)
    assert json.loads(json.loads(redacted_nested)["arguments"]) == parsed
    python_dict = repr(value)  # `{'password': 12345678}`, as a Python tool prints it
    assert ast.literal_eval(redactor.redact_text(python_dict)[0]) == parsed


def test_a_query_credential_after_a_json_escaped_ampersand_is_redacted() -> None:
    """Go's encoding/json writes `&` as `\\u0026`: a presigned S3 URL or an Azure SAS URL in a
    tool result kept its signature."""
    signature = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0"
    url = f"https://b.s3.amazonaws.com/k?X-Amz-Date=20240101T000000Z&X-Amz-Signature={signature}"
    text = json.dumps({"url": url}).replace("&", "\\u0026")
    redacted, counts = Redactor().redact_text(text)
    assert signature not in redacted and counts == {"url_password": 1}
    assert json.loads(redacted)["url"].endswith("&X-Amz-Signature=[REDACTED:url_password]")


# The secrets found by themselves, not only with their name before them.
_FOUND_ALONE = [
    secret for _, _, secret in CASES if secret not in Redactor().redact_text(f"see {secret} .")[0]
]


@pytest.mark.parametrize("secret", _FOUND_ALONE)
@pytest.mark.parametrize("escape", ["%20", "%22", "%3D", "%3a"])
def test_a_secret_right_after_a_percent_escape_is_redacted(secret: str, escape: str) -> None:
    """In a URL a user pastes or a tool returns (`cmd=export%20OPENAI_API_KEY%3Dsk-...`) the
    escape ends in a letter or digit, which read as the token's neighbour: every key, token
    and card number after one went out as it was."""
    assert len(_FOUND_ALONE) >= 8
    assert secret not in Redactor().redact_text(f"q=see{escape}{secret}{escape}here")[0]


@pytest.mark.parametrize("card", ["4111111111111111", "5555555555554444", "378282246310005"])
def test_a_card_number_after_a_literal_percent_is_redacted(card: str) -> None:
    """A SQL LIKE pattern (`'%4111...%'`): read as the escape `%41`, the card's run started
    two digits in and failed Luhn."""
    redacted, counts = Redactor().redact_text(f"WHERE pan LIKE '%{card}%'")
    assert card not in redacted and counts == {"credit_card": 1}


@dataclasses.dataclass
class _Note:
    text: str


class _Struct(msgspec.Struct):
    text: str


@pytest.mark.parametrize(
    "value",
    [
        b"OPENAI_API_KEY=sk-proj-Abc123def456GHI789jkl012MNO345",
        bytearray(b"mail bob@example.com"),
        _Note("mail bob@example.com"),
        _Struct("mail bob@example.com"),
        {"mail bob@example.com"},
    ],
    ids=["bytes", "bytearray", "dataclass", "struct", "set"],
)
def test_redact_obj_refuses_types_it_cannot_read(value: object) -> None:
    # These used to come back as they were: the walk only looks into str, dicts and lists.
    # (Bytes were not even searched: JSON writes them as base64, hiding every needle.)
    with pytest.raises(TypeError, match="cannot redact a value of type"):
        Redactor().redact_obj({"request": {"blob": value}})
    with pytest.raises(TypeError, match="cannot redact a dict key of type"):
        Redactor().redact_obj({("bob@example.com", 1): "x"})


def test_redact_obj_still_walks_every_json_type() -> None:
    class Name(str):
        pass

    body = {
        "a": ("mail bob@example.com", 1, 2.5, True, None),
        1: "call +1 415 555 0100",
        Name("bob@example.com"): [None, False],
    }
    redacted, counts = Redactor().redact_obj(body)
    assert redacted == {
        "a": ["mail [REDACTED:email]", 1, 2.5, True, None],
        1: "call [REDACTED:phone]",
        "[REDACTED:email]": [None, False],
    }
    assert counts == {"email": 2, "phone": 1}
    clean = {"blob": b"\x00\x01 no needle", "n": 1}
    assert Redactor().redact_obj(clean) == (clean, {})  # nothing that could match: as is


@pytest.mark.parametrize(
    "text",
    [
        "sk-" * 30_000,
        "a." * 50_000 + "@",
        "a-" * 50_000 + "@",
        "a@" + "b." * 50_000,
        "-----BEGIN PRIVATE KEY-----x" * 4_000,
        "eyJa-" * 20_000,
        "curl -u " * 12_000,
        "x://y:z/" * 12_000,
        "password=" * 12_000,
        "PASSWORD=x" * 10_000,
        "db_pass=" * 12_000,
        "apiKey=" * 14_000,
        'password: "' * 10_000,
        "password: " + "a." * 50_000,
        "password: str" * 8_000,
        'password: \\\\\\"' * 8_000,
        "npm_" * 25_000,
        "pypi-AgEIcHlwaS5vcmc" * 5_000,
        "dckr_pat_a-" * 9_000,
        "aaa1Q~" * 16_000,
        "x://u:" + "a@b/c" * 20_000,
        "x://u:a" + "@b/c/d" * 16_000 + "@",
        "http://h:x/y," * 8_000,
        "see x:// and " + "a-b." * 25_000,
        "x://u:a@b/c@" + "a." * 50_000,
        "x://u:p@h/p@" + "1." * 50_000,
        "machine a.b login u " * 5_000,
        "machine a.b login u password" + " " * 100_000,
        "mysql " * 16_000,
        "mysql -p" * 12_000,
        "sshpass -p " * 9_000,
        "redis-cli -a " * 8_000,
        "<password>a" * 9_000,
        "<password>a</" + "x" * 100_000,
        'key="password" value="' * 5_000,
        "token=" * 16_000,
        '"token": "' * 9_000,
        "TOKEN=" + "a1" * 50_000,
        '"password": ' + "1" * 100_000,
        "password=abcd " * 8_000,
        "é." * 50_000 + "@",
        "\\u00e9" * 16_000 + "@",
        "a@" + "é." * 50_000,
        "a@" + "例." * 50_000,
        "a@" + "\\u4f8b." * 16_000,
    ],
    ids=[
        "sk",
        "dotted-local",
        "dashed-local",
        "dotted-domain",
        "begin",
        "eyJ",
        "curl",
        "urls",
        "password=",
        "PASSWORD=x",
        "db_pass=",
        "apiKey=",
        "password-quote",
        "password-dotted",
        "password-type",
        "password-escaped-quote",
        "npm",
        "pypi",
        "dckr",
        "azure",
        "url-at-slash",
        "url-at-slash-chain",
        "url-comma",
        "url-scheme-runs",
        "url-host-labels",
        "url-version-labels",
        "netrc",
        "netrc-spaces",
        "mysql",
        "mysql-p",
        "sshpass",
        "redis-cli",
        "xml-open",
        "xml-unclosed",
        "xml-attribute",
        "token=",
        "token-quote",
        "token-long",
        "json-number",
        "plain-words",
        "accented-local",
        "escaped-local",
        "accented-domain",
        "cjk-domain",
        "escaped-domain",
    ],
)
def test_pathological_text_is_redacted_in_linear_time(text: str) -> None:
    # Each of these made a pattern rescan the rest of the text from every candidate start
    # (20-40 s for 100 KB); the proxy redacts what clients send, so that was a cheap way to
    # tie up its sink worker.
    started = time.perf_counter()
    Redactor().redact_text(text)
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize(
    "text",
    [
        "docker run -u 1000:1000 img && python -u main.py",
        "curl -u $USER:$PASS https://api.example.com/",
        "var a = b;password = getpw();",
        "conn = 'Server=x;Database=y;Password=' + pw",
        'url = f"https://api.example.com/v1?token={token}&page={page}"',
        "GET /admin/ui/login?token=... opens the UI",
        "headers = {'x-api-key': settings.OPENAI_API_KEY_VALUE}",
        "X-Api-Key: <your key here>",
        "The session_token= and api_key= parameters are documented below.",
        "x = 1//0 if debug else 2",
        "Send the Authorization: Token header with each request; see Authorization: Key docs.",
    ],
)
def test_lookalikes_of_query_header_and_connection_string_credentials_stay(text: str) -> None:
    assert Redactor().redact_text(text) == (text, {})


def test_each_pass_needle_is_found_wherever_its_pattern_matches() -> None:
    # Passes are skipped when their needle is absent, and `redact_obj` skips the whole
    # object: a needle that misses a match would let that secret through unread.
    redactor = Redactor()
    matched = set()
    for _, text, _ in CASES:
        for variant in (text, text.upper(), text.lower(), json.dumps(text)):
            for kind, pattern, needle in redactor._passes:
                if pattern.search(variant):
                    matched.add(kind.name)
                    assert needle.search(variant, []), (kind.name, variant)
    assert matched == {kind.name for kind, _, _ in redactor._passes}  # every kind was tried


@pytest.mark.parametrize(
    "secret",
    [
        "AKIAIOSFODNN7EXAMPLE",
        "sk-proj-Abc123def456GHI789jkl012MNO345",
        "ghp_" + "A1b2C3d4E5" * 4,
        "glpat-xYz12AbC34dEf56GhI78jK",
        "xoxb-1234567890-0987654321-AbCdEfGhIjKl",
        "sk_live_51H8xAbCdEfGhIjKlMnOp",
        "hf_" + "AbCdEfGhIj" * 3 + "Klmn",
        "AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q",
        JWT,
        "Bearer abc123DEF456ghi789.jkl",
        "bob@example.com",
        "4111 1111 1111 1111",
        "+1 415 555 0100",
    ],
)
@pytest.mark.parametrize("escape", ["\n", "\t", "\r", "\u00e9"])
def test_a_secret_right_after_an_escape_in_json_text_is_redacted(secret: str, escape: str) -> None:
    # An `.env` file or a log in a tool result that is itself JSON: each line's first
    # token follows `\n` (or `\u00e9`), whose last character is a word character.
    redactor = Redactor()
    value = f"A=1{escape}{secret}{escape}B=2"
    arguments = json.dumps({"content": value})
    redacted, counts = redactor.redact_text(arguments)
    assert secret not in redacted
    assert sum(counts.values()) == 1
    assert json.loads(redacted) == {"content": redactor.redact_text(value)[0]}


@pytest.mark.parametrize(("kind", "text", "secret"), CASES)
@pytest.mark.parametrize("before", ["密钥是", "トークン", "ключ"])
def test_a_secret_right_after_non_ascii_text_is_redacted(
    before: str, kind: str, text: str, secret: str
) -> None:
    # Chinese and Japanese put no space between a word and what follows it. With Unicode
    # word boundaries, `密钥是sk-...`, `邮箱bob@example.com` or a card number after a CJK
    # character had no boundary before it and went out as it was.
    redacted, counts = Redactor().redact_text(before + text)
    assert secret not in redacted
    assert counts == {kind: 1}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("DB_PASSWORD=hunter2x", "DB_PASSWORD=[REDACTED:secret_assignment]"),
        (
            "DB_USER=app\nDB_PASSWORD=hunter2x\nDB_HOST=db\n",
            "DB_USER=app\nDB_PASSWORD=[REDACTED:secret_assignment]\nDB_HOST=db\n",
        ),
        (
            'export MYSQL_ROOT_PASSWORD="s3cr3t!"',
            'export MYSQL_ROOT_PASSWORD="[REDACTED:secret_assignment]"',
        ),
        (
            "PGPASSWORD=abc123 psql -h db -U app",
            "PGPASSWORD=[REDACTED:secret_assignment] psql -h db -U app",
        ),
        ('password: "abc123def"', 'password: "[REDACTED:secret_assignment]"'),
        ("  password: abc123def  # prod", "  password: [REDACTED:secret_assignment]  # prod"),
        # An environment variable's value in a compose file, even a plain word.
        ("    POSTGRES_PASSWORD: postgres", "    POSTGRES_PASSWORD: [REDACTED:secret_assignment]"),
        ("DB_PASS=correcthorse", "DB_PASS=[REDACTED:secret_assignment]"),
        (
            "Set `DB_PASSWORD=postgres` in .env",
            "Set `DB_PASSWORD=[REDACTED:secret_assignment]` in .env",
        ),
        ('{"db_pass": "Tr0ub4dor&3"}', '{"db_pass": "[REDACTED:secret_assignment]"}'),
        (
            '{\\"password\\": \\"abc1234\\"}',
            '{\\"password\\": \\"[REDACTED:secret_assignment]\\"}',
        ),
        ("client_secret = 'x7Kq-94fT_zz'", "client_secret = '[REDACTED:secret_assignment]'"),
        (
            "[client]\nuser = root\npassword = hunter2x\n",
            "[client]\nuser = root\npassword = [REDACTED:secret_assignment]\n",
        ),
        (
            "spring.datasource.password=s3cret1",
            "spring.datasource.password=[REDACTED:secret_assignment]",
        ),
        ("SECRET_KEY=django-insecure-9xk2", "SECRET_KEY=[REDACTED:secret_assignment]"),
        ("OPENAI_API_KEY=not-a-known-format", "OPENAI_API_KEY=[REDACTED:secret_assignment]"),
        ('const apiKey = "a1b2c3d4e5";', 'const apiKey = "[REDACTED:secret_assignment]";'),
        ("dbPassword: hunter2x", "dbPassword: [REDACTED:secret_assignment]"),
        ("  db_pwd: 'n0t-s3cret'", "  db_pwd: '[REDACTED:secret_assignment]'"),
        ("'password' => 's3cret1',", "'password' => '[REDACTED:secret_assignment]',"),
        ('password: str = "hunter2x"', 'password: str = "[REDACTED:secret_assignment]"'),
        (
            "mysql --password=hunter2x -u root",
            "mysql --password=[REDACTED:secret_assignment] -u root",
        ),
        # A secret-access-key name with no 40-character AWS secret after it.
        ('"SecretAccessKey": "short/key+1"', '"SecretAccessKey": "[REDACTED:secret_assignment]"'),
        # Values with spaces: any quoted one of a passphrase, a JSON pair's of a password
        # (a login tool's arguments); they went out whole.
        (
            '{"passphrase": "correct horse battery staple"}',
            '{"passphrase": "[REDACTED:secret_assignment]"}',
        ),
        (
            'export GPG_PASSPHRASE="my long pass phrase"',
            'export GPG_PASSPHRASE="[REDACTED:secret_assignment]"',
        ),
        (
            "wifi_passphrase: 'purple monkey dishwasher'",
            "wifi_passphrase: '[REDACTED:secret_assignment]'",
        ),
        (
            '{"user": "bob", "password": "correct horse battery staple"}',
            '{"user": "bob", "password": "[REDACTED:secret_assignment]"}',
        ),
        (
            '{\\"db_password\\": \\"two words\\"}',
            '{\\"db_password\\": \\"[REDACTED:secret_assignment]\\"}',
        ),
    ],
)
def test_secret_assignments_lose_their_value_and_keep_their_name(text: str, expected: str) -> None:
    # These went to Kafka as they were: no built-in kind knew a password without a format.
    assert Redactor().redact_text(text) == (expected, {"secret_assignment": 1})


@pytest.mark.parametrize(
    "text",
    [
        'password = request.form["password"]',
        "password: str",
        "def login(user: str, password: str | None = None) -> bool:",
        "password: Optional[str] = None",
        "password=None",
        'conn = connect(host=h, password=os.environ["DB_PASSWORD"])',
        "password = getpass()",
        "if password == confirm:",
        "f(user=u, password=pw1)",
        "password = self.password\nPASSWORD = settings.DB_PASSWORD",
        "password_hash = bcrypt.hash(pw)",
        # A setting about passwords is not one.
        "PASSWORD_MIN_LENGTH=8",
        # Empty values and placeholders.
        "password: \"\"\nDB_PASSWORD=\npassword=''",
        "password: ${DB_PASSWORD}\nDB_PASSWORD=$DB_PASSWORD",
        'password: "{{ secrets.DB_PASSWORD }}"\npassword: ${{ secrets.DB_PASSWORD }}',
        'password = "%s" % pw',
        '"password": "<your password>", "secret": "********"',
        'api_key="sk-...",  # your key',
        "password: !vault |",
        # Prose, other names, the shell's working directory.
        '"forgot_password": "Forgot your password?"',
        '{"password": "Enter your password", "passphrase": "<your pass phrase>"}',
        'password: "two words"\nthe passphrase is "not this one"',
        "secretName: db-credentials-v2",
        "docker login -u bob --password-stdin",
        "PWD=/home/user/project\nOLDPWD=/tmp",
        "bypass=abc123 and pass",
        # Found in installed packages: a Triton argument, annotated constants, lambdas,
        # names of secrets as values, examples in docstrings.
        "HAS_PASS=rotary_dim < head_dim,",
        "PLAIN_PASSWORD: SocketOption = SocketOption.PLAIN_PASSWORD",
        '"S3_SECRET_ACCESS_KEY": lambda: os.environ.get("S3_SECRET_ACCESS_KEY", None),',
        'apiKey = "apiKey"\nENV_API_KEY = "ANTHROPIC_API_KEY"',
        'AttributeOID.CHALLENGE_PASSWORD: "challengePassword",',
        'WebhooksServer(webhook_secret="my_secret_key")\nsecret="my-secret",',
        "hf spaces create -s OPENAI_API_KEY=sk-... -s ANTHROPIC_API_KEY=sk-...",
        "SECRET_KEY: SecretStr",
    ],
)
def test_code_and_placeholders_that_only_name_a_secret_stay(text: str) -> None:
    assert Redactor().redact_text(text) == (text, {})


@pytest.mark.parametrize(
    "text",
    [
        "npm_config_registry=https://registry.npmjs.org/ npm_package_version=1.2.3",
        "npm_" + "abcdefghij" * 3 + "klmnop",  # 36 lower-case letters: a name
        "Every token starts with pypi-AgEIcHlwaS5vcmc, the issuer.",
        "DOCKER_TOKEN=dckr_pat_xxxxx",
        "~" * 44,
        ".menu.open~.overlay~.page{transform:none} /* a CSS sibling selector */",
        "aaa1Q~" + "b" * 40,  # longer than any client secret
    ],
)
def test_lookalikes_of_registry_tokens_and_client_secrets_stay(text: str) -> None:
    assert Redactor().redact_text(text) == (text, {})


@pytest.mark.parametrize(
    "secret",
    [
        "kT38Q~" + "Vw1xYz.2Ab" * 3 + "Cd~E",  # 34 after `8Q~`, as Microsoft issues them
        ".Xy8Q~" + "m4-Np_Qr5s" * 3 + "T~uV",
        "Ab.7Q~" + "Zz9yX.wV8u" * 3 + "t",  # an older one: 31 after `7Q~`
    ],
)
def test_azure_client_secrets_are_redacted_whole(secret: str) -> None:
    for text in (f"client_secret={secret}", f'"ClientSecret": "{secret}"', f"({secret})"):
        redacted, counts = Redactor().redact_text(text)
        assert redacted == text.replace(secret, "[REDACTED:azure_client_secret]")
        assert counts == {"azure_client_secret": 1}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # An `@` in the path after a host without a dot, followed by a version or a digest:
        # the path stays (it used to go with the password, up to that `@`).
        (
            "https://u:pw@localhost/npm/pkg@1.0",
            "https://u:[REDACTED:url_password]@localhost/npm/pkg@1.0",
        ),
        (
            "https://u:pw@localhost/npm/pkg@1.0.0-beta.1/x.js",
            "https://u:[REDACTED:url_password]@localhost/npm/pkg@1.0.0-beta.1/x.js",
        ),
        (
            "pip install git+https://u:tok@gitserver/org/repo.git@v1.2.3#egg=x",
            "pip install git+https://u:[REDACTED:url_password]@gitserver/org/repo.git@v1.2.3#egg=x",
        ),
        (
            "docker://u:pw@registry/img@sha256:0123abcd",
            "docker://u:[REDACTED:url_password]@registry/img@sha256:0123abcd",
        ),
        # A password holding `@` and `/` is still redacted whole when a host follows its
        # last `@`: a name, an IPv4 address, an IPv6 literal or a placeholder.
        ("https://u:a@b/c@host/path", "https://u:[REDACTED:url_password]@host/path"),
        ("https://u:a@b/c@host", "https://u:[REDACTED:url_password]@host"),
        (
            "https://u:a@b/c@10.0.0.1:8080/x",
            "https://u:[REDACTED:url_password]@10.0.0.1:8080/x",
        ),
        ("https://u:a@b/c@[::1]:8080/", "https://u:[REDACTED:url_password]@[::1]:8080/"),
        (
            "redis://:p@ss/w@${HOST}:6379/0",
            "redis://:[REDACTED:url_password]@${HOST}:6379/0",
        ),
        (
            '{"url": "ftp://u:p@ss/w0rd@files.example.com/pub", "n": 1}',
            '{"url": "ftp://u:[REDACTED:url_password]@files.example.com/pub", "n": 1}',
        ),
    ],
)
def test_a_url_password_ends_at_the_last_at_sign_that_a_host_follows(
    text: str, expected: str
) -> None:
    assert Redactor().redact_text(text) == (expected, {"url_password": 1})


RANDOM_HEX = "3f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c"
RANDOM_B62 = "Xk29fLm3Qp8sVt4wZr7yBn1cHd6J"
TOKEN_SECRETS = [
    f'"token": "{RANDOM_HEX}"',
    f"token={RANDOM_HEX}",
    f"TOKEN={RANDOM_HEX}",
    f"export GITHUB_TOKEN={RANDOM_B62}",
    f"auth_token: {RANDOM_B62}",
    f'access_token = "{RANDOM_B62}"',
    f"refresh_token: '{RANDOM_HEX}'",
    f"api_token={RANDOM_B62} ./deploy.sh",
    f'{{"accessToken": "{RANDOM_B62}", "expiresIn": 3600}}',
    "authtoken: 2bVdLq8sQ1mZp4xT7wRk9YcN3aF_6hJgUe5Ks1Mo",  # ngrok
    "BOT_TOKEN=110201543:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw",  # Telegram
    "RUNNER_TOKEN=3f2504e0-4f89-11d3-9a0c-0305e82c3301",
    f"<token>{RANDOM_HEX}</token>",
    f"<sessionToken>{RANDOM_B62}</sessionToken>",
]


@pytest.mark.parametrize("text", TOKEN_SECRETS)
def test_a_random_value_under_a_token_name_is_redacted(text: str) -> None:
    # `token`, `auth_token`, `access_token`, ... were no secret names: their values went out.
    redacted, counts = Redactor().redact_text(text)
    assert counts == {"secret_assignment": 1}
    assert RANDOM_HEX not in redacted and RANDOM_B62 not in redacted
    assert "[REDACTED:secret_assignment]" in redacted


VLLM_LOGPROBS = {
    "id": "chatcmpl-1",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello world"},
            "logprobs": {
                "content": [
                    {
                        "token": token,
                        "logprob": -0.01 * n,
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {"token": token, "logprob": -0.01 * n, "bytes": list(token.encode())},
                            {"token": "token_id:151643", "logprob": -9.5, "bytes": None},
                        ],
                    }
                    # Tokenizer pieces, and pieces that are long and random-looking.
                    for n, token in enumerate(
                        [
                            "Hello",
                            " world",
                            "token",
                            "_ids",
                            " 1234",
                            "Ġthe",
                            RANDOM_HEX,
                            RANDOM_B62,
                        ]
                    )
                ]
            },
        }
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
}


TOKEN_LOOKALIKES = [
    # Tokenizer and sampling code.
    "token = tokenizer(x)",
    "token: str",
    "tokens = []",
    "token_ids=[1,2]",
    "max_tokens=256",
    'pad_token = "<|pad|>"\neos_token: "</s>"\nunk_token="[UNK]"',
    "image_token = tokenizer.image_token",
    'token = self.stream.expect("name")',
    "next_token = torch.multinomial(probs, num_samples=1)",
    # A logprobs entry, also vLLM's `token_id:<n>` form and a random-looking piece.
    '{"token": "Hello", "logprob": -0.1}',
    '{"token": "token_id:151643", "logprob": -0.1, "bytes": null}',
    f'{{"token": "{RANDOM_HEX}", "logprob": -0.1}}',
    f'\\"token\\": \\"{RANDOM_B62}\\", \\"logprob\\": -2.5',
    # Values that read as words, names of classes, hashes that are no secrets.
    "'service_account_token': 'V1ServiceAccountTokenProjection'",
    'AWS_IMDSV2_SESSION_TOKEN = "awsimdsv2sessiontoken"',
    '"token": "color-primary-500"',
    'token = "welcome_message_2"',
    "TOKEN=my_tokenizer_v2",
    '"token_type": "bearer", "token": "abcdef"',
    'publicKeyToken="1fc8b3b9a1e18e3b"',
    '"nextPageToken": "CiAKGjBpNDd2Nmp2Zml2cXRwYjBpOXA3czcxb3o5EAAaAA"',
    "Next page token: eav1OzQB0OM8rLdGXOEsyQWSG",
    'verify_token="eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9..."',  # a cut-off example
    "<NextToken>2YgYW55IGNhcm5hbCBwbGVhc3VyZS4=</NextToken>",
    'token: "${{ secrets.NPM_TOKEN }}"',
    '"token": 15339',
]


@pytest.mark.parametrize("text", TOKEN_LOOKALIKES)
def test_token_names_in_code_and_logprobs_stay(text: str) -> None:
    assert Redactor().redact_text(text) == (text, {})


def test_logprobs_stay_in_a_trajectory_as_objects_and_as_json_text() -> None:
    # Trajectories hold thousands of `{"token": ..., "logprob": ...}` entries: as objects
    # (each string walked on its own) and as JSON text in a tool message or argument.
    redactor = Redactor()
    assert redactor.redact_obj(VLLM_LOGPROBS) == (VLLM_LOGPROBS, {})
    for separators in ((", ", ": "), (",", ":")):
        text = json.dumps(VLLM_LOGPROBS, separators=separators)
        assert redactor.redact_text(text) == (text, {})
        message = {"role": "tool", "content": text}
        assert redactor.redact_obj(message) == (message, {})
        nested = json.dumps({"result": text})  # escaped quotes
        assert redactor.redact_text(nested) == (nested, {})


MORE_SECRETS = [
    # XML elements and `value` attributes.
    ("<password>hunter</password>", "<password>[REDACTED:secret_assignment]</password>"),
    (
        "<server><id>r</id><username>u</username><password>repopwd</password></server>",
        "<server><id>r</id><username>u</username>"
        "<password>[REDACTED:secret_assignment]</password></server>",
    ),
    (
        "<db.password>changeme</db.password>",
        "<db.password>[REDACTED:secret_assignment]</db.password>",
    ),
    ("<apiKey>abc123xyz</apiKey>", "<apiKey>[REDACTED:secret_assignment]</apiKey>"),
    (
        "<clientSecret>x7Kq-94fT</clientSecret>",
        "<clientSecret>[REDACTED:secret_assignment]</clientSecret>",
    ),
    (
        '<add key="ClearTextPassword" value="s3cretvalue" />',
        '<add key="ClearTextPassword" value="[REDACTED:secret_assignment]" />',
    ),
    (
        '<property name="password" value="hunter"/>',
        '<property name="password" value="[REDACTED:secret_assignment]"/>',
    ),
    # .netrc entries, on one line or several (also as JSON text).
    (
        "machine github.com login octocat password hunter",
        "machine github.com login octocat password [REDACTED:secret_assignment]",
    ),
    (
        "machine api.heroku.com\n  login me\n  password 01234567-89ab\nmachine localhost",
        "machine api.heroku.com\n  login me\n  password [REDACTED:secret_assignment]\n"
        "machine localhost",
    ),
    (
        '{"c": "machine x.io\\n  login u\\n  password hunter\\n"}',
        '{"c": "machine x.io\\n  login u\\n  password [REDACTED:secret_assignment]\\n"}',
    ),
    # Command lines: `-p<password>` of the MySQL clients, `sshpass -p`, `redis-cli -a`.
    ("mysql -uroot -pS3cret app", "mysql -uroot -p[REDACTED:secret_assignment] app"),
    (
        "mysqldump -h db -P 3306 -u root -p'hunter' app > dump.sql",
        "mysqldump -h db -P 3306 -u root -p'[REDACTED:secret_assignment]' app > dump.sql",
    ),
    (
        'docker exec db mariadb -u root -phunter -e "SHOW DATABASES"',
        'docker exec db mariadb -u root -p[REDACTED:secret_assignment] -e "SHOW DATABASES"',
    ),
    (
        "sshpass -p 'hunter' ssh deploy@host",
        "sshpass -p '[REDACTED:secret_assignment]' ssh deploy@host",
    ),
    (
        "redis-cli -h cache -p 6379 -a hunter ping",
        "redis-cli -h cache -p 6379 -a [REDACTED:secret_assignment] ping",
    ),
    # JSON numbers and plain words.
    ('{"password": 12345678}', '{"password": "[REDACTED:secret_assignment]"}'),
    (
        "{'db_password': 20240101, 'user': 'x'}",
        "{'db_password': '[REDACTED:secret_assignment]', 'user': 'x'}",
    ),
    (
        "spring:\n  datasource:\n    username: sa\n    password: postgres\n",
        "spring:\n  datasource:\n    username: sa\n    password: [REDACTED:secret_assignment]\n",
    ),
    (
        "[client]\nuser=root\npassword=changeme\n",
        "[client]\nuser=root\npassword=[REDACTED:secret_assignment]\n",
    ),
    (
        'psycopg2.connect("host=db user=app password=changeme dbname=app")',
        'psycopg2.connect("host=db user=app password=[REDACTED:secret_assignment] dbname=app")',
    ),
    ("password: changeme  # default", "password: [REDACTED:secret_assignment]  # default"),
    # An environment variable's value followed by an option.
    (
        "docker run -e MYSQL_ROOT_PASSWORD=my-secret-pw -d mysql:8",
        "docker run -e MYSQL_ROOT_PASSWORD=[REDACTED:secret_assignment] -d mysql:8",
    ),
]


@pytest.mark.parametrize(("text", "expected"), MORE_SECRETS)
def test_xml_netrc_command_line_number_and_plain_word_secrets_are_redacted(
    text: str, expected: str
) -> None:
    assert Redactor().redact_text(text) == (expected, {"secret_assignment": 1})


MORE_LOOKALIKES = [
    # XML: no value, a placeholder, a boolean, a tag that closes something else.
    "<password></password>\n<password>${DB_PASS}</password>",
    "<AllowUsersToChangePassword>true</AllowUsersToChangePassword>",
    '<add key="RequirePassword" value="false"/>',
    '<property name="password" value="${jdbc.password}"/>',
    '<input type="password" value="{{ form.password }}">',
    "<label for=password>Passwort</label>",
    "<token>Hello</token>",
    # Prose and .netrc look-alikes.
    "The machine learning login page password field",
    "login with password and username",
    "machine example.com login bob password $NETRC_PASSWORD",
    # Command lines where `-p` is no password.
    "mysql -h db -P 3306 -u root -p mydb",
    'mysql -u root -p --database=test -e "select -price from t"',
    'mysqldump -u root -p"$MYSQL_ROOT_PASSWORD" db',
    "pip -p 8080 install x; ssh -p 2222 host; docker run -p 8080:80 mysql",
    "pymysql -pfoo; mysql-connector -pbar",
    "sshpass -f pwfile ssh u@h",
    "redis-cli -a $REDIS_PASSWORD ping",
    # Numbers that are no password, names that only mention one.
    '"password": 8',
    '{"password_min_length": 12345678}',
    '"passwordLength": 12345678,',
    # Code, types and words about the value.
    "password: str\npassword: Optional[str]\npassword = None",
    'password = request.form["password"]\npassword = get_password()',
    "password: string;\npassword: required\npassword: optional\nERROR password: incorrect",
    "password = pw\npassword=password\npassword = changeme",
    "password: hashedPw\n  password: hashed_pw\npassword := defaultpw",
    "const creds = {\n  username: user,\n  password: hashed\n};",
    "db = connect(\n    host=host,\n    password=changeme\n)",
    "f(password=changeme, user=u)\npassword: changeme,",
    'def f():\n    """Args:\n        password: secret\n    """',
    "password: &default_pw changeme",
]


@pytest.mark.parametrize("text", MORE_LOOKALIKES)
def test_xml_netrc_command_line_and_plain_word_lookalikes_stay(text: str) -> None:
    assert Redactor().redact_text(text) == (text, {})


def test_the_needles_of_the_token_and_other_new_passes_hold_wherever_they_match() -> None:
    # The token passes' needle is a regex of what must follow the name (so that a JSON text
    # of logprobs holds none); it must still hold wherever a pattern matches, or that secret
    # would pass unread.
    redactor = Redactor()
    texts = [*TOKEN_SECRETS, *TOKEN_LOOKALIKES, *(t for t, _ in MORE_SECRETS), *MORE_LOOKALIKES]
    matched = set()
    for text in texts:
        for variant in (text, text.upper(), text.lower(), json.dumps(text), json.dumps([text])):
            for index, (kind, pattern, needle) in enumerate(redactor._passes):
                if pattern.search(variant):
                    matched.add(index)
                    assert needle.search(variant, []), (kind.name, variant)
    assert len(matched) >= 10, matched  # the token passes and their neighbours were tried


# A walked object's strings were redacted without their keys: `{"password": "hunter2x"}`
# as a structure (feedback metadata, a request's `metadata`) reached Kafka as it was, while
# the same pair as JSON text was redacted.
SECRET_PAIRS = [
    ({"password": "hunter2x"}, 1),
    ({"db_pass": "postgres"}, 1),
    ({"client_secret": "s3cr3t-value"}, 1),
    ({"password": 12345678}, 1),  # a JSON number, as in text
    ({"password": 10**30}, 1),  # past 64 bits, as JSON allows
    ({"token": RANDOM_HEX}, 1),
    ({"refresh_token": RANDOM_B62 * 2}, 1),  # a string of 32+ bytes: another header
    ({"GITHUB_TOKEN": RANDOM_B62}, 1),
    ({"metadata": {"accessToken": RANDOM_HEX, "password": "hunter2x", "n": 1}}, 2),
    ([{"auth": {"api_key": "a1b2c3d4e5f6g7h8"}}], 1),
]


@pytest.mark.parametrize(("obj", "hits"), SECRET_PAIRS)
def test_secret_values_under_secret_keys_are_redacted_in_objects(obj: object, hits: int) -> None:
    redacted, counts = Redactor().redact_obj(obj)
    assert counts == {"secret_assignment": hits}
    text = json.dumps(redacted)
    assert "[REDACTED:secret_assignment]" in text
    for secret in ("hunter2x", "postgres", "s3cr3t-value", "12345678", RANDOM_HEX, RANDOM_B62):
        assert secret not in text


# Pairs whose JSON text another kind reads first (key-anchored kinds run before
# `secret_assignment`): the object kept the value while its text lost it.
PAIRS_OF_OTHER_KINDS = [
    {"aws_secret_access_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"},
    {"SecretAccessKey": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"},
    {"authorization": "Basic dXNlcjpwYXNzd29yZA=="},
    {"Authorization": "Token " + RANDOM_HEX},
    {"x-api-key": RANDOM_HEX},
]


@pytest.mark.parametrize("obj", PAIRS_OF_OTHER_KINDS)
def test_an_object_loses_what_its_json_text_loses(obj: dict[str, str]) -> None:
    redactor = Redactor()
    (value,) = obj.values()
    text, text_counts = redactor.redact_text(json.dumps(obj))
    assert text_counts and value not in text
    redacted, counts = redactor.redact_obj(obj)
    assert counts == text_counts, (counts, text_counts)
    assert value not in json.dumps(redacted)


PAIRS_THAT_STAY = [
    {"password": None},
    {"password": ""},
    {"password": True},
    {"password": 123},  # under 4 digits, as in text
    {"password": "${DB_PASSWORD}"},
    {"password_hint": "my dog"},
    {"max_tokens": 256, "messages": [{"role": "user", "content": "hi"}]},
    {"token": "Hello"},
    {"token": RANDOM_HEX, "logprob": -0.1, "bytes": [51]},  # a logprob entry: the model's text
    {"page_token": RANDOM_HEX},
    {"token_ids": [1, 2, 3], "tokens": ["a", "b"]},
    {"keyword": "python", "monkey": "island"},
    {"author": "Jane Doe", "authors": ["A. Turing"]},  # `auth` keys are read, not redacted
    {"GITHUB_TOKEN": "ab12" * 10},  # degenerate: no random value
]


@pytest.mark.parametrize("obj", PAIRS_THAT_STAY)
def test_values_under_look_alike_keys_stay_in_objects(obj: object) -> None:
    assert Redactor().redact_obj(obj) == (obj, {})


def test_secret_keys_in_objects_are_read_only_while_secret_assignment_is_on() -> None:
    obj = {"password": "hunter2x", "token": RANDOM_HEX}
    assert Redactor(kinds=["email"]).redact_obj(obj) == (obj, {})


# Ordinary prose, no needle of any kind in it: padding that makes a string or a structure
# long enough for the long-text cache and the walk of long structures.
_FILLER = "the quick brown fox jumps over the lazy dog and runs far away again " * 40


@pytest.mark.parametrize(("kind", "text", "secret"), CASES[::3], ids=lambda v: str(v)[:24])
def test_a_long_text_is_redacted_alike_from_the_cache(kind: str, text: str, secret: str) -> None:
    """A string of 2,048 characters or more is redacted once per Redactor and then taken from
    its cache: the second time (an equal string, another object, as the next record of the
    conversation brings it) gives the same text and counts, and the counts are the caller's
    own to change."""
    long_text = _FILLER + text + "\n" + _FILLER
    assert len(long_text) >= 2048
    redactor = Redactor()
    first, first_counts = redactor.redact_text(long_text)
    assert secret not in first and first_counts.get(kind, 0) >= 1
    first_counts[kind] = 999  # the caller's copy
    again, again_counts = redactor.redact_text("".join([_FILLER, text, "\n", _FILLER]))
    assert (again, again_counts) == (first, {**first_counts, kind: again_counts[kind]})
    assert again_counts[kind] != 999
    assert (again, again_counts) == Redactor(long_text_cache_chars=0).redact_text(long_text)


@pytest.mark.parametrize(("kind", "text", "secret"), CASES[1::3], ids=lambda v: str(v)[:24])
def test_a_long_structure_is_redacted_as_a_short_one(kind: str, text: str, secret: str) -> None:
    """A structure whose text is over 32,768 characters is walked string by string (its long
    strings from the cache) instead of searched as one text first: what is redacted in it,
    and the counts, are what a short structure with the same strings gets."""
    long_message = {"role": "user", "content": _FILLER * 14}
    short = {"messages": [{"role": "user", "content": text}], "metadata": {"note": text}}
    long = {"messages": [long_message, *short["messages"]], "metadata": short["metadata"]}
    assert len(json.dumps(long)) > 32_768
    redactor = Redactor()
    short_redacted, short_counts = redactor.redact_obj(short)
    for _ in range(2):  # the second time, the long string comes from the cache
        long_redacted, long_counts = redactor.redact_obj(json.loads(json.dumps(long)))
        assert long_redacted["messages"][0] == long_message
        assert long_redacted["messages"][1:] == short_redacted["messages"]
        assert long_redacted["metadata"] == short_redacted["metadata"]
        assert long_counts == short_counts and short_counts.get(kind, 0) >= 1
        assert secret not in json.dumps(long_redacted, ensure_ascii=False)
    # Without the cache the structure is searched whole first, as before: the same result.
    assert Redactor(long_text_cache_chars=0).redact_obj(long) == (long_redacted, long_counts)


def test_a_long_structure_without_needles_is_returned_unchanged() -> None:
    body = {"messages": [{"role": "user", "content": _FILLER * 14}], "n": [1, 2.5, None]}
    redactor = Redactor()
    for _ in range(2):
        assert redactor.redact_obj(json.loads(json.dumps(body))) == (body, {})


def test_the_long_text_cache_keeps_at_most_its_characters() -> None:
    from safety.redaction import _LongTextCache

    cache = _LongTextCache(max_chars=10_000)
    texts = [f"{i:04d}" + "x" * 2996 for i in range(5)]  # 3,000 characters each
    for text in texts[:3]:
        cache.put(text, (text, {}))
    assert cache.get(texts[0]) == (texts[0], {})  # now the most recently used
    cache.put(texts[3], (texts[3], {}))  # 12,000 > 10,000: the least recently used goes
    assert cache.get(texts[1]) is None
    assert all(cache.get(t) is not None for t in (texts[0], texts[2], texts[3]))
    redacted = "[REDACTED:email]" + "y" * 2990
    cache.put(texts[4], (redacted, {"email": 1}))  # its text and its redaction both count
    assert cache.get(texts[4]) == (redacted, {"email": 1})
    assert cache.get(texts[0]) is None and cache.get(texts[2]) is None
    cache.put("z" * 20_000, ("z" * 20_000, {}))  # larger than the whole cache: not kept
    assert cache.get("z" * 20_000) is None and cache.get(texts[4]) is not None


def test_a_redactor_pickles_without_its_cache() -> None:
    """The proxy pickles its Redactor to the sink's worker process with the record builder."""
    import pickle

    redactor = Redactor()
    long_text = _FILLER + "mail jane@example.com" + _FILLER
    expected = redactor.redact_text(long_text)
    copy = pickle.loads(pickle.dumps(redactor))
    assert copy.redact_text(long_text) == expected
    assert copy.redact_obj({"a": long_text}) == ({"a": expected[0]}, expected[1])


@pytest.mark.parametrize(
    ("text", "counts", "secret"),
    [
        (
            "smtp://Jane.Doe%40corp.example:pw@mail.example",
            {"email": 1, "url_password": 1},
            "Jane.Doe",
        ),
        ("card 4111\u00a01111\u00a01111\u00a01111 exp", {"credit_card": 1}, "4111\u00a01111"),
        ("carte 4111\u202f1111\u202f1111\u202f1111", {"credit_card": 1}, "1111\u202f1111"),
        ("tel +33\u00a06\u00a012\u00a034\u00a056\u00a078", {"phone": 1}, "12\u00a034"),
        ("tel (415)\u00a0555\u20110100", {"phone": 1}, "555"),
    ],
)
def test_percent_encoded_addresses_and_non_breaking_separators_are_found(
    text: str, counts: dict[str, int], secret: str
) -> None:
    """An e-mail address in a URL is written `%40`, and numbers copied from web pages or
    written the French way are grouped by non-breaking spaces: none was found, so the
    record stayed trainable and went out as it was."""
    redacted, found = Redactor().redact_text(text)
    assert secret not in redacted and found == counts


def test_a_walked_object_loses_what_its_json_text_loses() -> None:
    """A card number as a JSON number, and a secret beside a `bytes` key, were redacted in
    an object's JSON text and kept in the walked object (feedback metadata, a request's
    extra fields). A logprob entry's `token` still stays as it is."""
    redactor = Redactor()
    card = {"order": {"card": 4111111111111111, "cc_number": 4111111111111111, "qty": 2}}
    redacted, counts = redactor.redact_obj(card)
    assert redacted == {
        "order": {
            "card": "[REDACTED:credit_card]",
            "cc_number": "[REDACTED:credit_card]",
            "qty": 2,
        }
    }
    assert counts == {"credit_card": 2}
    # Only under a key that names a card: a random 63-bit sampling seed passes the card
    # check about one time in seventeen, and its record lost its token ids.
    seeded = {"seed": 4814270268974188480, "ids": [4111111111111111, 7]}
    assert redactor.redact_obj(seeded) == (seeded, {})
    assert redactor.redact_obj({"n": 4111111111111112, "ms": 1733472000000}) == (
        {"n": 4111111111111112, "ms": 1733472000000},
        {},
    )  # not a card number by Luhn; a millisecond time
    paired = {"file": "id_rsa.pub", "bytes": 1024, "password": "hunter2x"}
    assert redactor.redact_obj(paired)[1] == {"secret_assignment": 1}
    entry = {"token": "password", "logprob": -0.1, "bytes": [112]}
    assert redactor.redact_obj(entry) == (entry, {})


def test_keys_that_come_out_alike_keep_every_value() -> None:
    """Feedback metadata keyed by three e-mail addresses was recorded with one entry: each
    key became `[REDACTED:email]`, and the last one won."""
    metadata = {"alice@example.com": "yes", "bob@example.com": "no", "carol@example.com": "-"}
    redacted, counts = Redactor().redact_obj(metadata)
    assert redacted == {
        "[REDACTED:email]": "yes",
        "[REDACTED:email]#2": "no",
        "[REDACTED:email]#3": "-",
    }
    assert counts == {"email": 3}


def test_a_printf_width_before_a_file_name_is_no_e_mail() -> None:
    text = 'sprintf(buf, "id%40d.log", n); fmt = "name%40s.txt"'
    assert Redactor().redact_text(text) == (text, {})
