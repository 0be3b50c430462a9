// Validate custom resources (one JSON document per line on stdin) against the CRD schemas
// that @kubernetes-models generates from KEDA's and the Prometheus Operator's published CRDs.
// Prints one line per document: "ok <kind>/<name>" or "invalid <kind>/<name>: <errors>".
import { createInterface } from "node:readline";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
import { TriggerAuthentication } from "@kubernetes-models/keda/keda.sh/v1alpha1/TriggerAuthentication";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const kinds = { ScaledObject, TriggerAuthentication, ServiceMonitor };
for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue;
  const doc = JSON.parse(line);
  const name = `${doc.kind}/${doc.metadata?.name}`;
  const Model = kinds[doc.kind];
  if (!Model) { console.log(`invalid ${name}: no schema for kind ${doc.kind}`); continue; }
  try { new Model(doc).validate(); console.log(`ok ${name}`); }
  catch (e) { console.log(`invalid ${name}: ${String(e.message).replace(/\n/g, " ")}`); }
}
