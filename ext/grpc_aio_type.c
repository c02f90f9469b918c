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
 *     token = var.set(call._deadline)
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
 * task's context), and reset when the handler ends, however it ends.  The
 * class's _tail (Python) decides the rare ends -- a handler that raised, or
 * a timer that fired -- and returns the coroutine that ends an expired call,
 * which the GrpcAioCoro then awaits in place of the handler.  Everything
 * here runs in the loop's thread with the GIL held; a GrpcAioCoro's
 * `running` flag refuses a re-entrant send/throw/close.
 */
#include "grpc_call.h"

#if PY_VERSION_HEX >= 0x030C0000

enum { A_CREATED, A_HANDLER, A_TAIL, A_CLOSED };

typedef struct {
    PyObject_HEAD
    GrpcUnaryObject *w; /* the wrapper, strong */
    int state;
    int running;              /* inside send/throw/close */
    PyObject *request, *ctx;  /* the arguments, until started */
    GrpcCallObject *call;     /* while the handler runs */
    PyObject *token;          /* the variable's, while the handler runs */
    PyObject *inner;          /* what is awaited: the handler's, then the tail */
} GrpcAioCoroObject;
#define AIOCORO_REFS(X) X(w) X(request) X(ctx) X(call) X(token) X(inner)

EXT_GC_TRAVERSE(GrpcAioCoro, GrpcAioCoroObject, AIOCORO_REFS)
EXT_GC_CLEAR(GrpcAioCoro, GrpcAioCoroObject, AIOCORO_REFS)

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
 * first step of the tail that ends an expired call. */
static PySendResult aio_handler_ended(GrpcAioCoroObject *self, PySendResult r,
                                      PyObject **result) {
    GrpcUnaryObject *w = self->w;
    GrpcCallObject *c = self->call;
    Py_CLEAR(self->inner);
    Py_CLEAR(c->where);
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
    /* the `finally` block */
    PyObject *token = self->token;
    self->token = NULL;
    if (PyContextVar_Reset(w->var, token) < 0) {
        err = chained(PyErr_GetRaisedException(), err);
        Py_CLEAR(tail);
    }
    Py_DECREF(token);
    Py_CLEAR(self->call);
    if (err || (tail && tail != Py_None)) Py_CLEAR(*result);
    if (tail && tail != Py_None) { /* expired: await the tail */
        Py_CLEAR(err);
        PyObject *inner = ext_awaitable_iter(w->st, tail);
        Py_DECREF(tail);
        if (!inner) {
            self->state = A_CLOSED;
            return PYGEN_ERROR;
        }
        self->inner = inner;
        self->state = A_TAIL;
        r = PyIter_Send(inner, Py_None, result);
        if (r != PYGEN_NEXT) {
            Py_CLEAR(self->inner);
            self->state = A_CLOSED;
        }
        return r;
    }
    Py_XDECREF(tail);
    self->state = A_CLOSED;
    if (err) {
        PyErr_SetRaisedException(err);
        return PYGEN_ERROR;
    }
    return PYGEN_RETURN;
}

/* The first send(None): the call begun, the variable set, the handler
 * called and driven to its first suspension (or its end). */
static PySendResult aio_start(GrpcAioCoroObject *self, PyObject **result) {
    GrpcUnaryObject *w = self->w;
    PyObject *request = self->request, *ctx = self->ctx;
    self->request = self->ctx = NULL;
    self->state = A_CLOSED; /* until the variable is set */
    PySendResult r = PYGEN_ERROR;
    PyObject *task = PyObject_CallNoArgs(w->current_task);
    if (!task) goto out;
    PyObject *loop = ext_running_loop(&w->st->compat); /* the timer fires in it */
    GrpcCallObject *c = loop ? ext_grpc_call_begin(w, ctx, task, loop) : NULL;
    Py_XDECREF(loop);
    Py_DECREF(task);
    if (!c) goto out;
    PyObject *token = PyContextVar_Set(w->var, c->deadline);
    if (!token) {
        c->done = 1;
        if (ext_grpc_cancel_timer(w, c->handle) < 0) PyErr_WriteUnraisable((PyObject *)w);
        Py_DECREF(c);
        goto out;
    }
    self->call = c;
    self->token = token;
    self->state = A_HANDLER;
    PyObject *bargs[2] = {request, c->deadline == Py_None ? ctx : (PyObject *)c};
    PyObject *coro = PyObject_Vectorcall(w->behavior, bargs, 2, NULL);
    if (!coro) {
        r = aio_handler_ended(self, PYGEN_ERROR, result);
        goto out;
    }
    c->where = coro; /* the live stack at the threshold is read from it */
    self->inner = ext_awaitable_iter(w->st, coro);
    if (!self->inner) {
        r = aio_handler_ended(self, PYGEN_ERROR, result);
        goto out;
    }
    r = PyIter_Send(self->inner, Py_None, result);
    if (r != PYGEN_NEXT) r = aio_handler_ended(self, r, result);
out:
    Py_DECREF(request);
    Py_DECREF(ctx);
    return r;
}

/* One step: send(arg) when exc is NULL, else throw(exc). */
static PySendResult aio_step(GrpcAioCoroObject *self, PyObject *arg, PyObject *exc,
                             PyObject **result) {
    *result = NULL;
    if (self->running) {
        PyErr_SetString(PyExc_ValueError, "coroutine already executing");
        return PYGEN_ERROR;
    }
    if (self->state == A_CLOSED) {
        if (exc) PyErr_SetRaisedException(Py_NewRef(exc));
        else PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return PYGEN_ERROR;
    }
    if (self->state == A_CREATED) {
        if (exc) { /* thrown in before it started: nothing ran, it never will */
            self->state = A_CLOSED;
            Py_CLEAR(self->request);
            Py_CLEAR(self->ctx);
            PyErr_SetRaisedException(Py_NewRef(exc));
            return PYGEN_ERROR;
        }
        if (arg != Py_None) {
            PyErr_SetString(PyExc_TypeError,
                            "can't send non-None value to a just-started coroutine");
            return PYGEN_ERROR;
        }
        if (!self->w->cls) { /* its wrapper was cleared by the GC */
            PyErr_SetString(PyExc_RuntimeError, "this GrpcAioUnary was cleared");
            return PYGEN_ERROR;
        }
    }
    self->running = 1;
    PySendResult r;
    if (self->state == A_CREATED) {
        r = aio_start(self, result);
    } else {
        r = exc ? ext_throw_into(self->w->st, self->inner, exc, result)
                : PyIter_Send(self->inner, arg, result);
        if (r != PYGEN_NEXT) {
            if (self->state == A_HANDLER) {
                r = aio_handler_ended(self, r, result);
            } else {
                Py_CLEAR(self->inner);
                self->state = A_CLOSED;
            }
        }
    }
    self->running = 0;
    if (r == PYGEN_ERROR) *result = NULL;
    return r;
}

static PySendResult GrpcAioCoro_am_send(GrpcAioCoroObject *self, PyObject *arg,
                                        PyObject **result) {
    return aio_step(self, arg, NULL, result);
}

static PyObject *GrpcAioCoro_iternext(GrpcAioCoroObject *self) {
    PyObject *result;
    PySendResult r = aio_step(self, Py_None, NULL, &result);
    if (r == PYGEN_RETURN && result == Py_None) { /* StopIteration(None), unraised */
        Py_DECREF(result);
        return NULL;
    }
    return ext_step_as_call(self->w->st, r, result);
}

static PyObject *GrpcAioCoro_send(GrpcAioCoroObject *self, PyObject *arg) {
    PyObject *result;
    PySendResult r = aio_step(self, arg, NULL, &result);
    return ext_step_as_call(self->w->st, r, result);
}

/* throw(exc) or the older throw(type[, value[, traceback]]) */
static PyObject *GrpcAioCoro_throw(GrpcAioCoroObject *self, PyObject *const *args,
                                   Py_ssize_t nargs) {
    PyObject *exc = ext_throw_args_exception(args, nargs);
    if (!exc) return NULL;
    PyObject *result;
    PySendResult r = aio_step(self, NULL, exc, &result);
    Py_DECREF(exc);
    return ext_step_as_call(self->w->st, r, result);
}

/* close(): GeneratorExit at the suspension point, after closing what is
 * awaited (a coroutine's close() does the same); the handler's end goes
 * through the call's end as any exception does. */
static PyObject *GrpcAioCoro_close(GrpcAioCoroObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->state == A_CREATED) {
        self->state = A_CLOSED;
        Py_CLEAR(self->request);
        Py_CLEAR(self->ctx);
        Py_RETURN_NONE;
    }
    if (self->state == A_CLOSED) Py_RETURN_NONE;
    PyObject *exc = PyObject_CallNoArgs(PyExc_GeneratorExit);
    if (!exc) return NULL;
    PyObject *result;
    PySendResult r = aio_step(self, NULL, exc, &result);
    Py_DECREF(exc);
    if (r == PYGEN_NEXT) {
        Py_DECREF(result);
        PyErr_SetString(PyExc_RuntimeError, "coroutine ignored GeneratorExit");
        return NULL;
    }
    if (r == PYGEN_RETURN) {
#if PY_VERSION_HEX >= 0x030D0000
        return result; /* 3.13: close() returns what the coroutine returned */
#else
        Py_DECREF(result);
        Py_RETURN_NONE;
#endif
    }
    if (PyErr_ExceptionMatches(PyExc_GeneratorExit) ||
        PyErr_ExceptionMatches(PyExc_StopIteration)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return NULL;
}

/* Like a coroutine's: close() if suspended; "never awaited" if never started. */
static void GrpcAioCoro_finalize(GrpcAioCoroObject *self) {
    if (self->state == A_CLOSED) return;
    PyObject *exc = PyErr_GetRaisedException();
    if (self->state == A_CREATED) {
        if (PyErr_WarnEx(PyExc_RuntimeWarning,
                         "coroutine 'bucketimer.grpc aio call' was never awaited", 1) < 0)
            PyErr_WriteUnraisable((PyObject *)self);
        self->state = A_CLOSED;
    } else {
        PyObject *r = GrpcAioCoro_close(self, NULL);
        if (r) Py_DECREF(r);
        else PyErr_WriteUnraisable((PyObject *)self);
    }
    PyErr_SetRaisedException(exc);
}

static PyObject *GrpcAioCoro_await(GrpcAioCoroObject *self) { return Py_NewRef(self); }

static PyObject *GrpcAioCoro_get_await(GrpcAioCoroObject *self, void *Py_UNUSED(c)) {
    return Py_NewRef(self->inner && !self->running ? self->inner : Py_None);
}

static PyObject *GrpcAioCoro_get_running(GrpcAioCoroObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(self->running);
}

static PyObject *GrpcAioCoro_get_suspended(GrpcAioCoroObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong((self->state == A_HANDLER || self->state == A_TAIL) &&
                           !self->running);
}

static PyObject *GrpcAioCoro_get_none(GrpcAioCoroObject *Py_UNUSED(self), void *Py_UNUSED(c)) {
    Py_RETURN_NONE;
}

static PyObject *GrpcAioCoro_get_name(GrpcAioCoroObject *Py_UNUSED(self), void *Py_UNUSED(c)) {
    return PyUnicode_FromString("both_coro");
}

static PyMethodDef GrpcAioCoro_methods[] = {
    {"send", (PyCFunction)GrpcAioCoro_send, METH_O,
     "send(arg) -> send 'arg' into coroutine,\nreturn next iterated value or raise StopIteration."},
    {"throw", (PyCFunction)(void (*)(void))GrpcAioCoro_throw, METH_FASTCALL,
     "throw(value)\nthrow(type[,value[,traceback]])\n\nRaise exception in coroutine, return next "
     "iterated value or raise StopIteration."},
    {"close", (PyCFunction)GrpcAioCoro_close, METH_NOARGS,
     "close() -> raise GeneratorExit inside coroutine."},
    {NULL}};

static PyGetSetDef GrpcAioCoro_getset[] = {
    {"cr_await", (getter)GrpcAioCoro_get_await, NULL, "object being awaited on, or None", NULL},
    {"cr_running", (getter)GrpcAioCoro_get_running, NULL, NULL, NULL},
    {"cr_suspended", (getter)GrpcAioCoro_get_suspended, NULL, NULL, NULL},
    {"cr_frame", (getter)GrpcAioCoro_get_none, NULL, "None: this coroutine has no Python frame",
     NULL},
    {"cr_code", (getter)GrpcAioCoro_get_none, NULL, "None: this coroutine has no code object",
     NULL},
    {"__name__", (getter)GrpcAioCoro_get_name, NULL, NULL, NULL},
    {"__qualname__", (getter)GrpcAioCoro_get_name, NULL, NULL, NULL},
    {NULL}};

static PyType_Slot GrpcAioCoro_slots[] = {
    {Py_tp_doc, "The coroutine a GrpcAioUnary returns: one call of its handler."},
    {Py_tp_dealloc, GrpcAioCoro_dealloc},
    {Py_tp_traverse, GrpcAioCoro_traverse},
    {Py_tp_clear, GrpcAioCoro_clear},
    {Py_tp_finalize, GrpcAioCoro_finalize},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, GrpcAioCoro_iternext},
    {Py_am_await, GrpcAioCoro_await},
    {Py_am_send, GrpcAioCoro_am_send},
    {Py_tp_methods, GrpcAioCoro_methods},
    {Py_tp_getset, GrpcAioCoro_getset},
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
    self->w = (GrpcUnaryObject *)Py_NewRef(w);
    self->state = A_CREATED;
    self->running = 0;
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
