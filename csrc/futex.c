/*
 * futex.c -- the timer thread sleeps on its signal counter.  Waiting with the
 * value it read under the wake mutex means a wake that lands between reading
 * and sleeping makes the wait return at once: no wake is ever lost
 * (docs/design.rst rule 4).  Elsewhere a condition variable would do the same; only
 * Linux is built and tested.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <time.h>

#include "internal.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

void bt__futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
    struct timespec ts, *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000);
        ts.tv_nsec = (long)(timeout_ns % 1000000000);
        tsp = &ts;
    }
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, tsp, NULL, 0);
}

void bt__futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}
#else
#error "bucketimer's core needs a futex; only Linux is supported for now"
#endif
