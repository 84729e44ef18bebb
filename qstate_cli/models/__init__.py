"""Small built-in models used by `qstate trace demo` and `qstate bench train`."""
