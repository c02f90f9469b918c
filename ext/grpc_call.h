/*
 * grpc_call.h -- what the sync and the aio C wrappers of bucketimer.grpc
 * share (grpc_unary_type.c owns it all; grpc_aio_type.c uses it): the
 * call object GrpcCall, the wrapper's layout, and the start of a call
 * (its budget, a GrpcCall from the wrapper's free list, its one timer).
 */
#ifndef BUCKETIMER_GRPC_CALL_H
#define BUCKETIMER_GRPC_CALL_H

#include "module.h"

#define GRPC_CALL_FREELIST 16 /* a sync server's pool threads, each in one call */

typedef struct GrpcUnaryObject GrpcUnaryObject;

typedef struct {
    PyObject_HEAD
    GrpcUnaryObject *wrapper; /* strong: its free list takes this back */
    PyObject *ctx;            /* grpc's servicer context */
    PyObject *deadline;       /* a float, or None: no budget */
    PyObject *source;         /* "max_time" or "client"; NULL without a budget */
    PyObject *task;           /* None, or an aio handler's task */
    PyObject *handle;         /* the first timer's Handle */
    PyObject *handle2;        /* the second timer's, or None */
    PyObject *where;          /* an aio handler's coroutine while it runs; else NULL */
    PyObject *abort;          /* Python's: how the handler's end met an abort (None) */
    double start;
    double bound;             /* Python's: the earliest deadline given downstream (inf) */
    unsigned long ident;      /* the handler's thread */
    int claimed;              /* Python's: the questions its timer and its end decided */
    char expired, done, slow, first_slow;
} GrpcCallObject;
#define GRPC_CALL_REFS(X) X(wrapper) X(ctx) X(deadline) X(source) X(task) X(handle) X(handle2) \
    X(where) X(abort)

/* The wrapped behaviour of one method: GrpcUnary (sync) and GrpcAioUnary
 * share this layout, its construction, GC and free list. */
struct GrpcUnaryObject {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    ext_state *st;
    PyTypeObject *cls;  /* the method's GrpcCall subclass */
    PyObject *behavior; /* the handler's */
    PyObject *var;      /* the deadline ContextVar */
    PyObject *timers;   /* () -> the TimerThread to use (the interceptor's _timers) */
    PyObject *tt;       /* what timers() last returned */
    int tt_native;      /* ... a TimerThread whose call_at is the core's */
    PyObject *fire;     /* cls._fire(call): the first timer's callback */
    PyObject *tail;     /* cls._tail(call, exc): the end of a call whose timer fired */
    PyObject *end_expired; /* cls._end_expired_slow(call, slow) (sync only) */
    PyObject *current_task; /* asyncio.current_task (aio only) */
    PyObject *str_time_remaining, *str_max_time, *str_client, *str_closed, *str_call_at,
        *str_cancel;
    PyObject *dict;     /* grpc reads and sets attributes of a behaviour */
    double threshold, max_time; /* max_time NaN: none */
    double early;       /* cls._early: a client budget's first timer is this much before it */
    ext_freelist calls;
    PyObject *call_store[GRPC_CALL_FREELIST];
};
#define GRPC_UNARY_REFS(X)                                                                     \
    X(cls) X(behavior) X(var) X(timers) X(tt) X(fire) X(tail) X(end_expired) X(current_task)  \
    X(str_time_remaining) X(str_max_time) X(str_client) X(str_closed) X(str_call_at)            \
    X(str_cancel) X(dict)

/* A wrapper of type `tp` (GrpcUnary's layout) from the constructor's
 * common arguments, checked; `vectorcall` is how it is called.  NULL on
 * error. */
GrpcUnaryObject *ext_grpc_unary_make(PyTypeObject *tp, vectorcallfunc vectorcall, PyObject *cls,
                                     PyObject *behavior, PyObject *var, PyObject *timers,
                                     double threshold, PyObject *max_time_o);
int ext_grpc_unary_traverse(GrpcUnaryObject *self, visitproc visit, void *arg);
int ext_grpc_unary_clear(GrpcUnaryObject *self);
void ext_grpc_unary_dealloc(GrpcUnaryObject *self);
extern PyGetSetDef ext_grpc_unary_getset[];
extern PyMemberDef ext_grpc_unary_members[];

/* A call begun: its budget from ctx.time_remaining() and max_time, a
 * GrpcCall of w->cls for it (`task`: its _task, NULL: None) and its one timer
 * armed at the earlier of the threshold and the deadline (w->early before
 * it when the budget is the client's deadline), delivered to `loop`
 * (None: the dispatcher thread).  NULL on error. */
GrpcCallObject *ext_grpc_call_begin(GrpcUnaryObject *w, PyObject *ctx, PyObject *task,
                                    PyObject *loop);
/* 1 if the timer was cancelled (it never fires), 0 if not, -1 on error. */
int ext_grpc_cancel_timer(GrpcUnaryObject *w, PyObject *h);

#endif
