"""kit - what every chapter shares and none of them teaches: flags, workloads, benchmark
statistics, and the pieces of a server (OpenAI's wire format, the thread/asyncio bridge,
operations, the launcher).

The numbered scripts at the top level are the book; this package is their toolbox.
It imports no numbered script, so any chapter can use it without an import loop.
"""
