"""The OpenAI Files and Batches APIs (issue 40): files stored in a directory, their and the
batches' records in Redis, and one runner per deployment (elected through Redis) that
sends a batch's lines through the gateway's own proxy in a band below every interactive
one, only into capacity that interactive traffic leaves idle, and writes each line's
result once, so a batch resumes after a kill."""
