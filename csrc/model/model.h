/*
 * model.h -- what every harness of csrc/model/ shares (docs/design.rst,
 * "Model checks"; tools/model_check.py runs them):
 * nondeterministic choices, and the join a harness's main() uses to wait for
 * its threads before it checks the outcome.
 *
 * Threads are started with CBMC's `__CPROVER_ASYNC_n: f();`.  A thread ends
 * with model_done(), a full fence and then its flag; main() waits with
 * model_join(), which reads the flags and then fences.  So under a weak
 * memory model everything a thread did is visible to main()'s assertions,
 * and nothing the protocol does is ordered by the harness's own join.
 */
#ifndef BT_MODEL_H
#define BT_MODEL_H

#include <pthread.h>
#include <stdint.h>

_Bool nondet_bool(void);
int64_t nondet_int64(void);
uint32_t nondet_uint32(void);

#define MODEL_FENCE() __CPROVER_fence("WWfence", "RRfence", "RWfence", "WRfence")

static inline void model_done(volatile int *flag) {
    MODEL_FENCE();
    *flag = 1;
}

#define model_join(cond)           \
    do {                           \
        __CPROVER_assume(cond);    \
        MODEL_FENCE();             \
    } while (0)

/* A mutex: an atomic test-and-set and a full fence (an acquire and a
 * release would do; a full fence orders no less).  CBMC's own model of
 * pthread_mutex_t writes the whole union on every unlock, 40-odd memory
 * events each; this writes one word.  Nothing here is recursive, and
 * trylock is not used on the paths checked. */
static inline int pthread_mutex_lock(pthread_mutex_t *m) {
    __CPROVER_atomic_begin();
    __CPROVER_assume(m->__data.__lock == 0);
    m->__data.__lock = 1;
    __CPROVER_atomic_end();
    MODEL_FENCE();
    return 0;
}

static inline int pthread_mutex_unlock(pthread_mutex_t *m) {
    MODEL_FENCE();
    __CPROVER_atomic_begin();
    m->__data.__lock = 0;
    __CPROVER_atomic_end();
    return 0;
}

#endif
