// tensorstash._ext.restorable_saves and value_ring: the pure rules of the node-local tier's
// holdings (tiers/holdings.h), bound so that tests can check them on made-up holdings. The tier
// itself runs inside the Manager (manager.cc, MultiTierManager).
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <string>

#include "bindings.h"
#include "errors.h"
#include "tensorstash/tiers/holdings.h"

namespace nb = nanobind;

namespace tensorstash::python {

void DefineHoldings(nb::module_& m) {
  m.def(
      "restorable_saves",
      [](const std::string& holdings_json) {
        std::map<int64_t, std::string> out;
        for (const auto& [step, save] :
             RestorableSaves(ValueOrThrow(HoldingsFromJson(holdings_json)))) {
          out[step] = save.save_id;
        }
        return out;
      },
      nb::arg("holdings_json"),
      "For each step the holdings (a JSON list, tiers/holdings.h) restore alone, the id of "
      "the save to restore. ValueError for a list that is not valid.");
  m.def("value_ring", &ValueRing, nb::arg("index"), nb::arg("count"),
        "The processes whose per-process values the holding of process `index` carries.");
}

}  // namespace tensorstash::python
