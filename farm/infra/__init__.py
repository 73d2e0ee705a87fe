"""Process and Redis plumbing every farm process shares: reaching Redis (`redis_client`), the managed
redis-server and its Sentinel set (`redis_server`), the Celery app (`broker`), the parent-death signal
(`orphans`), CPU-bound calls off the gevent hub (`cooperative`), the start-up heap out of the
garbage collector's full passes (`gc_heap`), log files (`logfiles`), private file modes
(`filemodes`), which process a pid is (`process_identity`), blocking generators read as their items come (`interleave`), and a native library's call on untrusted input contained in a child process (`sandbox`). Nothing here knows requests, models or workers."""
