"""An attempt's reply: the request sent and its headers awaited (``opener``), the bytes relayed
as they come (``relay``), a broken stream continued elsewhere (``resume``), or a degraded
reply given when no backend can answer (``rescue``)."""
