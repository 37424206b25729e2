"""Tenants: who calls (``keyring``), what they used (``usage``), and the limits each is
held to across every replica (``limits``)."""
