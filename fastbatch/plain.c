/* plain.c: calque_values.plain in C (the module calque_plain), about 7x faster than the Python
 * walk, which it replaces where it was built: a `modal run` call's arguments and its result are
 * each walked once to find what JSON would change silently (a tuple, a key not text), and that
 * walk was the typed encoding's whole cost on plain JSON (docs/benchmarks.md). The Python walk in
 * calque_values.py is the reference; tests/test_values.py holds the two to the same answers.
 * No Python code runs during the walk: exact types only, keys compared as text.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* 1: JSON carries v exactly (dicts with text keys but "$py", lists, str, int, float, bool,
 * None, exactly these types); 0: not; -1: an error set (RecursionError). */
static int plain(PyObject *v)
{
    PyTypeObject *t = Py_TYPE(v);
    int ok = 1;
    if (t == &PyUnicode_Type || t == &PyLong_Type || t == &PyFloat_Type || t == &PyBool_Type
        || v == Py_None)
        return 1;
    if (t != &PyList_Type && t != &PyDict_Type)
        return 0;
    if (Py_EnterRecursiveCall(" in calque_values.plain"))
        return -1;
    if (t == &PyList_Type) {
        for (Py_ssize_t i = 0; ok == 1 && i < PyList_GET_SIZE(v); i++)
            ok = plain(PyList_GET_ITEM(v, i));
    } else {
        Py_ssize_t at = 0;
        PyObject *key, *value;
        while (ok == 1 && PyDict_Next(v, &at, &key, &value))
            ok = Py_TYPE(key) == &PyUnicode_Type   /* text, and not "$py" (a length first) */
                 && (PyUnicode_GET_LENGTH(key) != 3 || PyUnicode_CompareWithASCIIString(key, "$py"))
                 ? plain(value) : 0;
    }
    Py_LeaveRecursiveCall();
    return ok;
}

static PyObject *plain_py(PyObject *module, PyObject *value)
{
    int ok = plain(value);
    return ok < 0 ? NULL : PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"plain", plain_py, METH_O, "Whether JSON carries the value exactly (calque_values.plain)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "calque_plain", NULL, -1, methods};

PyMODINIT_FUNC PyInit_calque_plain(void) { return PyModule_Create(&module); }
