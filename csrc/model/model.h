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

/* A mutex: one word, an atomic test-and-set and a full fence (an acquire
 * and a release would do; a full fence orders no less).  glibc's
 * pthread_mutex_t is a union of a struct and 40 bytes: CBMC tracks each
 * member and each byte as a shared variable, and a write to one member
 * writes them all, 40-odd memory events per lock, which its weak-memory
 * encodings multiply.  The core's mutex fields take this type instead (the
 * macros below apply to the core's files, which every harness includes
 * after this one).  Nothing here is recursive. */
typedef struct {
    int locked;
} model_mutex;

static inline int model_mutex_lock(model_mutex *m) {
    __CPROVER_atomic_begin();
    __CPROVER_assume(!m->locked);
    m->locked = 1;
    __CPROVER_atomic_end();
    MODEL_FENCE();
    return 0;
}

static inline int model_mutex_trylock(model_mutex *m) {
    int taken;
    __CPROVER_atomic_begin();
    taken = !m->locked;
    m->locked = 1;
    __CPROVER_atomic_end();
    MODEL_FENCE();
    return taken ? 0 : 16; /* EBUSY */
}

static inline int model_mutex_unlock(model_mutex *m) {
    MODEL_FENCE();
    __CPROVER_atomic_begin();
    m->locked = 0;
    __CPROVER_atomic_end();
    return 0;
}

static inline int model_mutex_init(model_mutex *m, const void *attr) {
    (void)attr;
    m->locked = 0;
    return 0;
}

static inline int model_mutex_destroy(model_mutex *m) {
    (void)m;
    return 0;
}

#define pthread_mutex_t model_mutex
#define pthread_mutex_lock model_mutex_lock
#define pthread_mutex_trylock model_mutex_trylock
#define pthread_mutex_unlock model_mutex_unlock
#define pthread_mutex_init model_mutex_init
#define pthread_mutex_destroy model_mutex_destroy

#endif
