/*
 * stdatomic.h for the model harnesses only (docs/design.rst, "Model
 * checks"): C11 atomics spelled in what CBMC models.  Each operation is one atomic section
 * (__CPROVER_atomic_begin/end), and its memory order becomes the fences of
 * the usual mapping onto a weakly ordered CPU:
 *
 *   relaxed   no fence
 *   acquire   RR+RW fence after the load (later accesses stay after it)
 *   release   RW+WW fence before the store (earlier accesses stay before it)
 *   acq_rel   both
 *   seq_cst   a full fence before and after
 *
 * Under sequential consistency the fences change nothing; under CBMC's
 * weak-memory models (--mm tso|pso) they are what keeps a store from
 * overtaking another.  A compare-exchange never fails spuriously here (the
 * _weak forms are strong): the core's weak CASes all sit in retry loops, so
 * a spurious failure is one more trip round the loop, not a new outcome.
 */
#ifndef BT_MODEL_STDATOMIC_H
#define BT_MODEL_STDATOMIC_H

typedef enum {
    memory_order_relaxed,
    memory_order_consume,
    memory_order_acquire,
    memory_order_release,
    memory_order_acq_rel,
    memory_order_seq_cst
} memory_order;

#define MODEL_FULL_FENCE() __CPROVER_fence("WWfence", "RRfence", "RWfence", "WRfence")

static inline void model_fence_before(memory_order mo) {
    if (mo == memory_order_seq_cst) MODEL_FULL_FENCE();
    else if (mo == memory_order_release || mo == memory_order_acq_rel)
        __CPROVER_fence("WWfence", "RWfence");
}

static inline void model_fence_after(memory_order mo) {
    if (mo == memory_order_seq_cst) MODEL_FULL_FENCE();
    else if (mo == memory_order_acquire || mo == memory_order_acq_rel ||
             mo == memory_order_consume)
        __CPROVER_fence("RRfence", "RWfence");
}

#define atomic_init(p, v) ((void)(*(p) = (v)))

#define atomic_load_explicit(p, mo)                                   \
    __extension__({                                                   \
        __typeof__((void)0, *(p)) model_v_;                           \
        model_fence_before((mo) == memory_order_seq_cst ? (mo) : memory_order_relaxed); \
        __CPROVER_atomic_begin();                                     \
        model_v_ = *(p);                                              \
        __CPROVER_atomic_end();                                       \
        model_fence_after(mo);                                        \
        model_v_;                                                     \
    })

#define atomic_store_explicit(p, v, mo)                               \
    __extension__({                                                   \
        __typeof__((void)0, *(p)) model_n_ = (v);                     \
        model_fence_before(mo);                                       \
        __CPROVER_atomic_begin();                                     \
        *(p) = model_n_;                                              \
        __CPROVER_atomic_end();                                       \
        model_fence_after((mo) == memory_order_seq_cst ? (mo) : memory_order_relaxed); \
        (void)0;                                                      \
    })

/* One read-modify-write: `op` computes model_n_ from model_o_. */
#define MODEL_RMW(p, mo, op)                                          \
    __extension__({                                                   \
        __typeof__((void)0, *(p)) model_o_, model_n_;                 \
        model_fence_before(mo);                                       \
        __CPROVER_atomic_begin();                                     \
        model_o_ = *(p);                                              \
        op;                                                           \
        *(p) = model_n_;                                              \
        __CPROVER_atomic_end();                                       \
        model_fence_after(mo);                                        \
        model_o_;                                                     \
    })

#define atomic_exchange_explicit(p, v, mo) MODEL_RMW(p, mo, model_n_ = (v))
#define atomic_fetch_add_explicit(p, v, mo) MODEL_RMW(p, mo, model_n_ = model_o_ + (v))
#define atomic_fetch_sub_explicit(p, v, mo) MODEL_RMW(p, mo, model_n_ = model_o_ - (v))

#define atomic_compare_exchange_strong_explicit(p, e, d, smo, fmo)    \
    __extension__({                                                   \
        _Bool model_ok_;                                              \
        __typeof__((void)0, *(p)) model_d_ = (d);                     \
        model_fence_before(smo);                                      \
        __CPROVER_atomic_begin();                                     \
        model_ok_ = *(p) == *(e);                                     \
        if (model_ok_) *(p) = model_d_;                               \
        else *(e) = *(p);                                             \
        __CPROVER_atomic_end();                                       \
        model_fence_after(model_ok_ ? (smo) : (fmo));                 \
        model_ok_;                                                    \
    })
#define atomic_compare_exchange_weak_explicit atomic_compare_exchange_strong_explicit

#define atomic_load(p) atomic_load_explicit(p, memory_order_seq_cst)
#define atomic_store(p, v) atomic_store_explicit(p, v, memory_order_seq_cst)
#define atomic_exchange(p, v) atomic_exchange_explicit(p, v, memory_order_seq_cst)
#define atomic_fetch_add(p, v) atomic_fetch_add_explicit(p, v, memory_order_seq_cst)
#define atomic_fetch_sub(p, v) atomic_fetch_sub_explicit(p, v, memory_order_seq_cst)
#define atomic_compare_exchange_strong(p, e, d) \
    atomic_compare_exchange_strong_explicit(p, e, d, memory_order_seq_cst, memory_order_seq_cst)
#define atomic_compare_exchange_weak atomic_compare_exchange_strong

#endif
