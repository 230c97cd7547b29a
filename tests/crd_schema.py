"""Strict, offline validation of a custom resource against its CRD's `openAPIV3Schema`.

The API server checks a custom resource against the structural schema of its CRD
version and drops ("prunes") the fields that schema does not list, unless a node
says `x-kubernetes-preserve-unknown-fields`: a misspelt field is lost without a
word. Here it is an error instead: `strict(schema)` closes every object schema
that lists `properties` and neither allows other ones (`additionalProperties`)
nor preserves unknown fields, and `errors(obj, schema)` validates with
`jsonschema` (the OpenAPI v3 keywords a CRD uses: `type`, `properties`,
`required`, `items`, `enum`, `pattern`, lengths and bounds, `anyOf` for
int-or-string, mean the same in JSON Schema draft 7).

Not evaluated: CEL rules (`x-kubernetes-validations`), `format`, `default`, list
and map types. A test checks by hand the CEL rules that concern its object.

Each schema lives in `tests/data/` as JSON with its source, release and version
named, so the tests need neither the network nor the steering repo's copy.
"""

import json
import os

import jsonschema

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def load(filename):
    """The stored schema file `tests/data/<filename>`: its metadata and `openAPIV3Schema`."""
    with open(os.path.join(DATA, filename)) as f:
        return json.load(f)


def strict(schema):
    """A copy of `schema` in which an object may hold only the fields it lists."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: strict(value) if key != "properties" else
              {name: strict(field) for name, field in value.items()}
              for key, value in schema.items()}
    if ("properties" in closed and "additionalProperties" not in closed
            and not closed.get("x-kubernetes-preserve-unknown-fields")):
        closed["additionalProperties"] = False
    return closed


def errors(obj, schema):
    """`obj`'s violations of `strict(schema)`, each as "path: message" (empty: valid)."""
    validator = jsonschema.Draft7Validator(strict(schema))
    return sorted(f"{'.'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}"
                  for error in validator.iter_errors(obj))
