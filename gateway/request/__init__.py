"""A request before its first attempt: parsed once (``parse``), told what Redis knows of it
in one round trip (``lookup``), and planned: where each attempt goes and what follows it
(``plan``). No bytes are sent from here."""
