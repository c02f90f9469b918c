/*
 * grpc_aio_type.c -- the per-call work of bucketimer.grpc's fused aio unary
 * wrapper (ServerDeadlineInterceptor inside SlowCallInterceptor, or
 * ServerDeadlineSlowCallInterceptor, serving a coroutine handler;
 * docs/grpc.rst, "Both at once" and "Costs") in C, 3.12 and later: what the
 * Python wrapper `both_coro` in grpc/aio.py does per call, without its
 * coroutine frame.
 *
 * GrpcAioUnary is the wrapped behaviour (one per method, vectorcall; the
 * Python side marks it a coroutine function, which grpc.aio asks).  It has
 * GrpcUnary's layout, construction, free list of calls and start of a call
 * (grpc_call.h).  Calling it returns a GrpcAioCoro, a coroutine as `await`
 * sees one (send/throw/close, __await__, a finaliser), which on its first
 * send does what `both_coro` does:
 *
 *     call = begin(context, current_task())      # budget, GrpcCall, one timer
 *     token = var.set(call if call._deadline is not None else None)
 *     try:
 *         call._where = coro = behavior(request, context or call)
 *         result = await coro                     # send/throw/close forwarded
 *     except BaseException as exc:
 *         if not <the class's _tail(call, exc)>: raise
 *     else:
 *         call._done = True
 *         if call._handle.cancel(): return result # in time: no Python at all
 *         if not <the class's _tail(call, None)>: return result
 *     finally:
 *         var.reset(token)
 *     await <what _tail returned: call._end_expired_slow()>
 *
 * The variable is set once, at the first send (which asyncio runs in the
 * task's context), and reset when the handler ends, however it ends; a
 * reset refused while the coroutine is closed (its task dropped and
 * collected outside its context) is dropped, as `both_coro` drops it.  The
 * class's _tail (Python) decides the rare ends -- a handler that raised, or
 * a timer that fired -- and returns the coroutine that ends an expired call,
 * which the GrpcAioCoro then awaits in place of the handler.  The coroutine
 * protocol itself (send/throw/close and its rules) is the C coroutine shell
 * of wait_for_type.c.  Everything here runs in the loop's thread with the
 * GIL held.
 */
#include "grpc_call.h"

#if PY_VERSION_HEX >= 0x030C0000

typedef struct {
    ext_coro co;              /* state and running flag: the shell's (module.h) */
    GrpcUnaryObject *w;       /* the wrapper, strong */
    int in_tail;              /* suspended in the tail, not the handler */
    PyObject *request, *ctx;  /* the arguments, until started */
    GrpcCallObject *call;     /* while the handler runs */
    PyObject *token;          /* the variable's, while the handler runs */
    PyObject *inner;          /* what is awaited: the handler's, then the tail */
} GrpcAioCoroObject;
#define AIOCORO_REFS(X) X(w) X(request) X(ctx) X(call) X(token) X(inner)

EXT_GC_TRAVERSE(GrpcAioCoro, GrpcAioCoroObject, AIOCORO_REFS)

/* Cleared by the GC, it is closed: a finaliser that reaches it afterwards
 * finds a coroutine that cannot be driven again (its wrapper is gone). */
static int GrpcAioCoro_clear(GrpcAioCoroObject *self) {
    self->co.state = EXT_CORO_CLOSED;
    AIOCORO_REFS(EXT_CLEAR_REF)
    return 0;
}

static void GrpcAioCoro_dealloc(GrpcAioCoroObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0) return; /* resurrected */
    PyObject_GC_UnTrack(self);
    GrpcAioCoro_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* `e` (stolen) with `context` (stolen) as its __context__, as raised
 * inside an `except` or `finally` block; the new reference. */
static PyObject *chained(PyObject *e, PyObject *context) {
    ext_raise_with_context(e, context);
    return PyErr_GetRaisedException();
}

/* The handler ended: `r` is PYGEN_RETURN with *result its value, or
 * PYGEN_ERROR with its exception raised.  Ends the call as `both_coro`
 * does from its `except`/`else` blocks on: the step's outcome, or the
 * first step of the tail that ends an expired call.  The wrapper and the
 * call are held across the Python code this runs (the handler's __del__,
 * cancel(), _tail). */
static PySendResult aio_handler_ended(GrpcAioCoroObject *self, PySendResult r,
                                      PyObject **result) {
    GrpcUnaryObject *w = (GrpcUnaryObject *)Py_NewRef(self->w);
    GrpcCallObject *c = (GrpcCallObject *)Py_NewRef(self->call);
    /* the handler's __del__ runs with no exception pending */
    PyObject *raised = r == PYGEN_ERROR ? PyErr_GetRaisedException() : NULL;
    Py_CLEAR(self->inner);
    Py_CLEAR(c->where);
    if (raised) PyErr_SetRaisedException(raised);
    PyObject *err = NULL;  /* what the step raises, unless a tail runs */
    PyObject *tail = NULL; /* what _tail returned: None, or the tail to await */
    if (r == PYGEN_RETURN) {
        c->done = 1;
        int cancelled = ext_grpc_cancel_timer(w, c->handle);
        if (cancelled < 0) {
            err = PyErr_GetRaisedException();
        } else if (!cancelled) { /* it fired: slow, expired or both (Python says) */
            tail = PyObject_CallFunctionObjArgs(w->tail, (PyObject *)c, Py_None, NULL);
            if (!tail) err = PyErr_GetRaisedException();
        }
    } else {
        PyObject *exc = PyErr_GetRaisedException();
        /* as in the `except` block: exc is being handled */
        PyObject *handled = PyErr_GetHandledException();
        PyErr_SetHandledException(exc);
        tail = PyObject_CallFunctionObjArgs(w->tail, (PyObject *)c, exc, NULL);
        PyErr_SetHandledException(handled);
        Py_XDECREF(handled);
        err = tail ? exc : chained(PyErr_GetRaisedException(), exc);
    }
    /* the `finally` block: what it raises has `err` as __context__, as
     * inside a `finally` that an exception runs (not what the caller of
     * send() or throw() was handling) */
    PyObject *token = self->token;
    self->token = NULL;
    PyObject *handled = err ? PyErr_GetHandledException() : NULL;
    if (err) PyErr_SetHandledException(err);
    int reset = PyContextVar_Reset(w->var, token);
    if (err) {
        PyErr_SetHandledException(handled);
        Py_XDECREF(handled);
    }
    if (reset < 0 && PyErr_ExceptionMatches(PyExc_ValueError)) {
        /* closed (the ValueError's __context__ a GeneratorExit) where its
         * dropped task was collected, outside the call's context: nothing
         * of the call's is set here; dropped, as both_coro drops it */
        PyObject *e = PyErr_GetRaisedException();
        PyObject *context = PyException_GetContext(e);
        int closing = context && PyErr_GivenExceptionMatches(context, PyExc_GeneratorExit);
        Py_XDECREF(context);
        if (closing) {
            Py_DECREF(e);
            reset = 0;
        } else {
            PyErr_SetRaisedException(e);
        }
    }
    if (reset < 0) {
        err = chained(PyErr_GetRaisedException(), err);
        Py_CLEAR(tail);
    }
    Py_DECREF(token);
    Py_CLEAR(self->call);
    Py_DECREF(c);
    if (err || (tail && tail != Py_None)) Py_CLEAR(*result);
    if (tail && tail != Py_None) { /* expired: await the tail */
        Py_CLEAR(err);
        PyObject *inner = ext_awaitable_iter(w->st, tail);
        Py_DECREF(tail);
        Py_DECREF(w);
        if (!inner) {
            self->co.state = EXT_CORO_CLOSED;
            return PYGEN_ERROR;
        }
        self->inner = Py_NewRef(inner);
        self->in_tail = 1;
        r = PyIter_Send(inner, Py_None, result);
        Py_DECREF(inner);
        if (r != PYGEN_NEXT) {
            Py_CLEAR(self->inner);
            self->co.state = EXT_CORO_CLOSED;
        }
        return r;
    }
    Py_DECREF(w);
    Py_XDECREF(tail);
    self->co.state = EXT_CORO_CLOSED;
    if (err) {
        PyErr_SetRaisedException(err);
        return PYGEN_ERROR;
    }
    return PYGEN_RETURN;
}

/* The first send(None): the call begun, the variable set, the handler
 * called and driven to its first suspension (or its end). */
static PySendResult aio_start(ext_coro *co, PyObject **result) {
    GrpcAioCoroObject *self = (GrpcAioCoroObject *)co;
    GrpcUnaryObject *w = self->w; /* (self's while it runs: the GC clears no reachable object) */
    if (!w->cls) { /* its wrapper was cleared by the GC */
        PyErr_SetString(PyExc_RuntimeError, "this GrpcAioUnary was cleared");
        return PYGEN_ERROR;
    }
    PyObject *request = self->request, *ctx = self->ctx;
    self->request = self->ctx = NULL;
    self->co.state = EXT_CORO_CLOSED; /* until the variable is set */
    PySendResult r = PYGEN_ERROR;
    PyObject *task = PyObject_CallNoArgs(w->current_task);
    if (!task) goto out;
    PyObject *loop = ext_running_loop(&w->st->compat); /* the timer fires in it */
    GrpcCallObject *c = loop ? ext_grpc_call_begin(w, ctx, task, loop) : NULL;
    Py_XDECREF(loop);
    Py_DECREF(task);
    if (!c) goto out;
    /* the call is the budget remaining() reads and propagation notes on */
    PyObject *token = PyContextVar_Set(w->var, c->deadline == Py_None ? Py_None : (PyObject *)c);
    if (!token) {
        c->done = 1;
        if (ext_grpc_cancel_timer(w, c->handle) < 0) PyErr_WriteUnraisable((PyObject *)w);
        Py_DECREF(c);
        goto out;
    }
    self->call = (GrpcCallObject *)Py_NewRef(c); /* c: ours too, across the handler */
    self->token = token;
    self->co.state = EXT_CORO_SUSPENDED;
    PyObject *bargs[2] = {request, c->deadline == Py_None ? ctx : (PyObject *)c};
    PyObject *coro = PyObject_Vectorcall(w->behavior, bargs, 2, NULL);
    PyObject *inner = NULL;
    if (coro) {
        c->where = coro; /* the live stack at the threshold is read from it */
        inner = ext_awaitable_iter(w->st, coro);
    }
    Py_DECREF(c);
    if (!inner) {
        r = aio_handler_ended(self, PYGEN_ERROR, result);
        goto out;
    }
    self->inner = Py_NewRef(inner);
    r = PyIter_Send(inner, Py_None, result);
    Py_DECREF(inner);
    if (r != PYGEN_NEXT) r = aio_handler_ended(self, r, result);
out:
    Py_DECREF(request);
    Py_DECREF(ctx);
    return r;
}

/* A later step: send(arg) when exc is NULL, else throw(exc), into the
 * handler or the tail. */
static PySendResult aio_resume(ext_coro *co, PyObject *arg, PyObject *exc, PyObject **result) {
    GrpcAioCoroObject *self = (GrpcAioCoroObject *)co;
    if (!self->inner) { /* (suspended, it has one; a cleared one is closed) */
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return PYGEN_ERROR;
    }
    PyObject *inner = Py_NewRef(self->inner);
    PySendResult r = exc ? ext_throw_into(co->st, inner, exc, result)
                         : PyIter_Send(inner, arg, result);
    Py_DECREF(inner);
    if (r == PYGEN_NEXT) return r;
    if (!self->in_tail) return aio_handler_ended(self, r, result);
    Py_CLEAR(self->inner);
    co->state = EXT_CORO_CLOSED;
    return r;
}

static void aio_discard(ext_coro *co) {
    GrpcAioCoroObject *self = (GrpcAioCoroObject *)co;
    Py_CLEAR(self->request);
    Py_CLEAR(self->ctx);
}

static PyObject *aio_awaiting(ext_coro *co) { return ((GrpcAioCoroObject *)co)->inner; }

/* "both_coro": the Python wrapper's name, for what it stands in for */
static const ext_coro_kind aio_kind = {"both_coro", aio_start, aio_resume, aio_discard,
                                       aio_awaiting};

static PyType_Slot GrpcAioCoro_slots[] = {
    {Py_tp_doc, "The coroutine a GrpcAioUnary returns: one call of its handler."},
    {Py_tp_dealloc, GrpcAioCoro_dealloc},
    {Py_tp_traverse, GrpcAioCoro_traverse},
    {Py_tp_clear, GrpcAioCoro_clear},
    EXT_CORO_SLOTS,
    {0, NULL}};

PyType_Spec GrpcAioCoro_spec = {
    .name = "bucketimer._core.GrpcAioCoro",
    .basicsize = sizeof(GrpcAioCoroObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = GrpcAioCoro_slots,
};

/* ---- GrpcAioUnary --------------------------------------------------------------------- */

static PyObject *GrpcAioUnary_vectorcall(GrpcUnaryObject *w, PyObject *const *args,
                                         size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "a unary behaviour takes (request, context)");
        return NULL;
    }
    GrpcAioCoroObject *self = PyObject_GC_New(GrpcAioCoroObject, w->st->GrpcAioCoro_Type);
    if (!self) return NULL;
    self->co.kind = &aio_kind;
    self->co.st = w->st;
    self->co.state = EXT_CORO_CREATED;
    self->co.running = 0;
    self->w = (GrpcUnaryObject *)Py_NewRef(w);
    self->in_tail = 0;
    self->request = Py_NewRef(args[0]);
    self->ctx = Py_NewRef(args[1]);
    self->call = NULL;
    self->token = self->inner = NULL;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* GrpcAioUnary(call_type, behavior, var, timers, threshold, max_time, current_task) */
static PyObject *GrpcAioUnary_new(PyTypeObject *tp, PyObject *args, PyObject *kwds) {
    PyObject *cls, *behavior, *var, *timers, *max_time_o, *current_task;
    double threshold;
    static char *kw[] = {"call_type", "behavior", "var", "timers", "threshold", "max_time",
                         "current_task", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO!OdOO:GrpcAioUnary", kw, &PyType_Type,
                                     &cls, &behavior, &PyContextVar_Type, &var, &timers,
                                     &threshold, &max_time_o, &current_task))
        return NULL;
    if (!PyCallable_Check(current_task)) {
        PyErr_SetString(PyExc_TypeError, "current_task must be callable");
        return NULL;
    }
    GrpcUnaryObject *w =
        ext_grpc_unary_make(tp, (vectorcallfunc)GrpcAioUnary_vectorcall, cls, behavior, var,
                            timers, threshold, max_time_o);
    if (w) w->current_task = Py_NewRef(current_task);
    return (PyObject *)w;
}

static PyType_Slot GrpcAioUnary_slots[] = {
    {Py_tp_doc, "GrpcAioUnary(call_type, behavior, var, timers, threshold, max_time, "
                "current_task)\n\n"
                "An aio coroutine behaviour served under a slow-call threshold and a deadline "
                "with one timer per call (bucketimer.grpc.aio); calling it returns the call's "
                "coroutine."},
    {Py_tp_new, GrpcAioUnary_new},
    {Py_tp_dealloc, ext_grpc_unary_dealloc},
    {Py_tp_traverse, ext_grpc_unary_traverse},
    {Py_tp_clear, ext_grpc_unary_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_getset, ext_grpc_unary_getset},
    {Py_tp_members, ext_grpc_unary_members},
    {0, NULL}};

PyType_Spec GrpcAioUnary_spec = {
    .name = "bucketimer._core.GrpcAioUnary",
    .basicsize = sizeof(GrpcUnaryObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = GrpcAioUnary_slots,
};

#endif /* 3.12 and later */
