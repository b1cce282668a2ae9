"""olp safety layer: what may leave the proxy, what may serve users, and who decided what.

- `safety.config`: the `safety` config section (`SafetyConfig`).
- `safety.redaction`: `Redactor` for PII and secrets.
- `safety.audit`: the hash-chained `AuditLog`, `verify`, `iter_records`, `format_record`.
- `safety.gates`: `run_gate_suite` on a candidate adapter against the incumbent.
- `safety.caps`: `apply_contribution_caps` on a training batch.

Depends only on `replay` and libraries (see docs/security.md).
"""
